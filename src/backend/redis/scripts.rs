//! Every Lua script of the crate, [`Script`], which sends one (`EVALSHA`,
//! or `EVAL` after [`is_noscript`]), and how replies and errors are read.
//! Which script an operation runs, with which keys and arguments, is the
//! job's (`job.rs`).
//!
//! | script | used by | keys | reply |
//! |---|---|---|---|
//! | [`ACQUIRE_LUA`] | `LockBackend::acquire` | lease | -3 / `pttl` |
//! | [`ACQUIRE_FENCED_LUA`] | `LockBackend::acquire_fenced` | lease, `lease:fence` (expires a fence window after its lease), and `lease:wait` for a key this process watches | `{1, fence}` / `{0, pttl}` |
//! | [`ACQUIRE_WAIT_LUA`] | `LockBackend::acquire` of a key this process watches | lease, `lease:wait` (the mark) | -3 / `pttl` |
//! | [`RELEASE_LUA`] | `LockBackend::release` | lease | 1 / 0 |
//! | [`RELEASE_NOTIFY_LUA`] | `LockBackend::release_notify` | lease, `lease:wait` | 1 / 0 |
//! | [`EXTEND_LUA`] | `LockBackend::extend` | lease | 1 / 0 |
//! | [`BATCH_LUA`] | the dispatch (`dispatch.rs`), several acquires ([`ACQUIRE_LUA`]), releases ([`RELEASE_LUA`]) and extends ([`EXTEND_LUA`]) at once | leases | one reply per key |
//! | [`CLAIM_LUA`] | `IdempotencyBackend::claim` | `prefix:{scope}:digest:idem`, `prefix:{scope}:idem-quota`, `prefix:{scope}:idem-bytes` | `{1}` / `{2, pttl}` / `{3}` / `{4, record}` / `{5, ms}` / `{6}` |
//! | [`COMPLETE_LUA`] | `IdempotencyBackend::complete` | the same three | 1 / 0 |
//! | [`EXTEND_CLAIM_LUA`] | `IdempotencyBackend::extend` | the same three | 1 / 0 |
//! | [`ABANDON_LUA`] | `IdempotencyBackend::abandon` | the same three | 1 / 0 |
//!
//! Data travels only as `KEYS` and `ARGV`, never spliced into a script, so
//! each script has one SHA-1 and is sent as `EVALSHA`. Lease values are the
//! owner's token as 32 hex characters; TTLs are milliseconds. The replay
//! entry is one hash: `s` state (`p` claimed, `d` done, `a` abandoned: a
//! tombstone), `t` claim token, `f`
//! fingerprint, `r` sealed record, `w` set when a duplicate waits (then the
//! record, or an empty message when the claim is freed, is published on the
//! channel named like the key); the scope's entries and bytes are counted
//! beside it (see [`CLAIM_LUA`]).
//!
//! Waiting for a lease (`RedisLockLayer::wait`): an acquire that finds the
//! key held while this process waits for it sets the mark `lease:wait`
//! (same slot; it expires a TTL after the last such acquire); a release
//! through [`RELEASE_NOTIFY_LUA`] that finds the mark publishes, with
//! `SPUBLISH` (sharded pub/sub: the channel is the lease key, so it lives
//! in the key's slot on a cluster), the first 16 hex characters of the
//! released token. A plain release ([`RELEASE_LUA`], the batch script) is
//! unchanged, and a notifying release of a key nobody marked publishes
//! nothing. The publication is a `pcall`: a client whose ACL forbids it
//! still releases (waiters then look again at the holder's expiry or with
//! a back-off).
//!
//! On a server with native commands (`probe.rs`: Valkey ≥ 9), a lease's
//! acquire, release and extend go out as `SET … NX PX … GET` (the holder's
//! time left read from its token, no `PTTL`), `DELIFEQ` and `SET … IFEQ`
//! instead (`job/native.rs`); the scripts above stay for everything else.
//! On every other server a plain acquire sent alone by a batching dispatch
//! (not on a cluster) goes as `SET … NX PX … GET` too (an acquire in a batch, or one that
//! found its own token, runs [`ACQUIRE_LUA`]'s steps), and the rest as
//! scripts.
//!
//! `RedlockBackend` has no script of its own: each of its nodes runs the lock
//! scripts above (or their native commands).

use std::sync::LazyLock;

use fred::bytes_utils::Str;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::{ClusterHash, CustomCommand, Key, Value};

use crate::backend::{BackendError, BackendErrorKind};

/// Take the key if free or already ours (a re-sent command after a lost
/// reply), else report the holder's remaining milliseconds. One `SET NX PX
/// GET` (Redis ≥ 7.0) takes a free key and says who holds a taken one; our
/// own token found there has its expiry pushed out.
///
/// `KEYS[1]` lease, `ARGV[1]` token, `ARGV[2]` TTL in ms. Replies
/// [`ACQUIRED`] (-3) acquired, else the holder's `PTTL` (≥ 0, or -1 for a
/// key without expiry).
pub(crate) const ACQUIRE_LUA: &str = r#"local cur = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if cur == false then return -3 end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return -3
end
return redis.call('PTTL', KEYS[1])"#;

/// The reply of [`ACQUIRE_LUA`] (and of an acquire in [`BATCH_LUA`]) that
/// means *acquired*; any other is the holder's `PTTL`.
pub(crate) const ACQUIRED: i64 = -3;

/// [`ACQUIRE_LUA`] plus a fencing token kept in `KEYS[2]` (the lease key
/// with `:fence` appended, same hash slot). A new lease gets
/// `max(counter + 1, server clock in µs)` (`TIME`), so a fence issued after
/// the counter is gone (expired, evicted, lost in a restart) is still larger
/// than every earlier one, as long as the server's clock did not go back
/// further than the counter outlived its last lease. The counter is written
/// with an expiry of `ARGV[3]` ms (the lease TTL plus the fence window),
/// pushed out by the amount a counter ahead of the clock is ahead, so that
/// it is gone only once the clock has passed it: fence state is bounded by
/// the keys locked within the last TTL + window. A re-sent acquire that
/// finds our own token gets the fence it already had (and never shortens
/// the counter's expiry); if the counter is gone by then (a lease renewed
/// past it), it gets a new, larger one.
///
/// Fences stay below 2^53, exact in Lua's doubles (µs since 1970 are about
/// 1.8e15); a counter that would pass it is an error, not a fence that
/// fails to grow, and so is a counter that is not a number (`nan`, which
/// Lua reads as NaN, passes every comparison), before anything is written.
///
/// `KEYS[1]` lease, `KEYS[2]` fence counter, `KEYS[3]` (optional) the
/// wait mark, set as in [`ACQUIRE_WAIT_LUA`] when the key is held;
/// `ARGV[1]` token, `ARGV[2]` TTL in ms, `ARGV[3]` the counter's lifetime
/// in ms. Replies `{1, fence}` acquired, `{0, pttl}` held.
pub(crate) const ACQUIRE_FENCED_LUA: &str = r#"local cur = redis.call('GET', KEYS[1])
if cur ~= false and cur ~= ARGV[1] then
  local left = redis.call('PTTL', KEYS[1])
  if KEYS[3] and redis.call('PTTL', KEYS[3]) < tonumber(ARGV[2]) then
    redis.pcall('SET', KEYS[3], '1', 'PX', ARGV[2])
  end
  return {0, left}
end
local fence = tonumber(redis.call('GET', KEYS[2]) or '')
if fence ~= nil and (fence ~= fence or fence >= 9007199254740992) then
  return redis.error_reply('fence counter is not a number below 2^53')
end
if cur ~= false and fence ~= nil then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3], 'GT')
  return {1, fence}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
fence = math.max(math.floor(fence or 0) + 1, now)
if fence >= 9007199254740992 then
  return redis.error_reply('fence counter would pass 2^53')
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local life = tonumber(ARGV[3]) + math.ceil((fence - now) / 1000)
redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', string.format('%d', life))
return {1, fence}"#;

/// [`ACQUIRE_LUA`] for a key that this process waits for: when the key is
/// held, mark it as waited for (`KEYS[2]`, `lease:wait`), for a TTL from
/// now unless the mark already lives longer, so that its release through
/// [`RELEASE_NOTIFY_LUA`] publishes. The mark is a `pcall` (under
/// `maxmemory` with `noeviction` a `SET` may be refused): without it the
/// acquire still answers, and the waiter wakes at the holder's expiry.
///
/// `KEYS[1]` lease, `KEYS[2]` mark, `ARGV[1]` token, `ARGV[2]` TTL in ms.
/// Replies as [`ACQUIRE_LUA`].
pub(crate) const ACQUIRE_WAIT_LUA: &str = r#"local cur = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if cur == false then return -3 end
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return -3
end
local left = redis.call('PTTL', KEYS[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.pcall('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return left"#;

/// Compare-and-delete, and if the key is marked as waited for (`KEYS[2]`),
/// `SPUBLISH` on the lease key's channel the first 16 hex characters of the
/// released token (so the releasing process can tell its own echo). The
/// mark stays (it expires on its own): other waiters may still wait. The
/// look at the mark and the publication are `pcall`s: an ACL without
/// `EXISTS` or the channel costs the waiters their wake-up (they look
/// again later, at the latest at their wait bound), never the release's
/// answer (its `DEL` stands).
///
/// `KEYS[1]` lease, `KEYS[2]` mark, `ARGV[1]` token. Replies 1 released, 0
/// not ours.
pub(crate) const RELEASE_NOTIFY_LUA: &str = r#"if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if redis.pcall('EXISTS', KEYS[2]) == 1 then
  redis.pcall('SPUBLISH', KEYS[1], string.sub(ARGV[1], 1, 16))
end
return 1"#;

/// Compare-and-delete.
///
/// `KEYS[1]` lease, `ARGV[1]` token. Replies 1 released, 0 not ours.
pub(crate) const RELEASE_LUA: &str = r#"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"#;

/// Compare-and-expire.
///
/// `KEYS[1]` lease, `ARGV[1]` token, `ARGV[2]` TTL in ms. Replies 1 extended,
/// 0 not ours.
pub(crate) const EXTEND_LUA: &str = r#"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"#;

/// Runs each operation like its own script ([`ACQUIRE_LUA`], [`RELEASE_LUA`],
/// [`EXTEND_LUA`]) and returns one reply per key. Every command goes through
/// `redis.pcall`, so an operation whose command fails (a key of the wrong
/// type, OOM on a `SET` under `maxmemory` with `noeviction`) replies its
/// error message (a string) and fails alone: the operations after it still
/// run.
///
/// `KEYS[i]` lease of the i-th operation. `ARGV[1]` is every operation in
/// one string, one after the other: its letter (`a` acquire, `r` release,
/// `e` extend), its 32-character token, its TTL in ms (empty for release)
/// and `;`. One argument instead of three per operation: fewer frames to
/// encode and parse on both ends (a release's `;` is found by its place,
/// the TTL's by a search). `ARGV[2]` `n` (sent on the native road,
/// a server with `DELIFEQ`): each release is one `DELIFEQ` instead of a
/// `GET` and a `DEL`, a command less inside the script for every request
/// (a server without it answers that release with its error message, and
/// the dispatch sends it again without `n`). Replies, one integer per key:
/// the acquire's (as [`ACQUIRE_LUA`]), 1 or 0 for release and extend.
pub(crate) const BATCH_LUA: &str = r#"local pcall, sub, find, byte, type = redis.pcall, string.sub, string.find, string.byte, type
local ops = ARGV[1]
local native = ARGV[2] == 'n'
local out = {}
local p = 1
for i = 1, #KEYS do
  local key = KEYS[i]
  local op = byte(ops, p)
  local tok = sub(ops, p + 1, p + 32)
  local ttl
  if op == 114 then
    p = p + 34
  else
    local e = find(ops, ';', p + 33, true)
    ttl = sub(ops, p + 33, e - 1)
    p = e + 1
  end
  local res
  if op == 97 then
    res = pcall('SET', key, tok, 'NX', 'PX', ttl, 'GET')
    if res == false then
      res = -3
    elseif res == tok then
      res = pcall('PEXPIRE', key, ttl)
      if type(res) == 'number' then res = -3 end
    elseif type(res) == 'string' then
      res = pcall('PTTL', key)
    end
  elseif op == 114 and native then
    res = pcall('DELIFEQ', key, tok)
  elseif op == 114 or op == 101 then
    local cur = pcall('GET', key)
    if cur == tok then
      if op == 114 then
        res = pcall('DEL', key)
      else
        res = pcall('PEXPIRE', key, ttl)
      end
    elseif type(cur) == 'table' then
      res = cur
    else
      res = 0
    end
  else
    res = 'unknown operation in the batch'
  end
  if type(res) == 'table' then res = res.err end
  out[i] = res
end
return out"#;

/// The first line of a script that must run when Redis is full (its
/// `maxmemory` reached under `noeviction`): the record of a handler that
/// ran, and the renewal of a claim whose handler runs. Without the flag
/// Redis refuses the script's first write, if it needs room, with OOM (a
/// script without a shebang line; a later write is never refused), and the
/// record would be lost, the key freed for the handler to run again (the
/// store's rule: a record is never refused for room). New claims keep
/// failing closed ([`CLAIM_LUA`] writes a new claim's hash first).
/// Shebang flags need Redis 7.0 or Valkey 7.2, the lowest servers the
/// crate takes.
macro_rules! allow_oom {
    () => {
        "#!lua flags=allow-oom\n"
    };
}

/// The Lua that every idempotency script starts with (after the line of
/// [`allow_oom`] where there is one): the server's clock
/// in ms, and the scope's bookkeeping. Each scope (`prefix:{scope}`) keeps a
/// sorted set `KEYS[2]` (`…:idem-quota`) of its entries, scored by expiry,
/// each member `digest:bytes` (claims count 0 bytes), and a counter
/// `KEYS[3]` (`…:idem-bytes`) of the recorded entries' bytes; each lives
/// at least as long as the entries it counts.
///
/// `keep(i, ms, sure)` makes `KEYS[i]` live at least `ms` more, in as few
/// commands as each case allows (every `redis.call` costs about as much as
/// a small command again in a script): a key just made by this script
/// (`sure` = `'new'`: no expiry yet, nothing in it outlives `ms`) gets a
/// plain `PEXPIRE`; one this script found (`sure` = `true`: every key these
/// scripts make gets an expiry in the same script) a `PEXPIRE … GT`, which
/// never shortens it (Redis ≥ 7.0); otherwise (`false`) a `PTTL` follows a
/// `PEXPIRE … GT` that changed nothing, and a key without expiry gets one.
/// A key made persistent by someone else (`PERSIST`) and then found `sure`
/// keeps no expiry: the entries' own expiry and the claims' pruning still
/// bound what it holds.
macro_rules! idem_prelude {
    () => {
        r#"local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function keep(i, ms, sure)
  if sure == 'new' then
    redis.call('PEXPIRE', KEYS[i], ms)
  elseif redis.call('PEXPIRE', KEYS[i], ms, 'GT') == 0 and not sure
    and redis.call('PTTL', KEYS[i]) == -1 then
    redis.call('PEXPIRE', KEYS[i], ms)
  end
end
"#
    };
}

/// Claim if absent (or ours: a re-sent command); else compare the
/// fingerprint and report in-flight (with PTTL) or the record, all in one
/// round trip. A request found in flight is marked as waited for (`w`), so
/// that its completion is published. A claim that finds the tombstone its
/// own request left when it gave up (`s` = `a`, see [`ABANDON_LUA`]) claims
/// nothing: it is a re-sent command landing after its caller answered. A
/// new claim is refused while the scope holds `ARGV[5]` entries or
/// `ARGV[6]` bytes of entries that have not expired: no unexpired entry is
/// ever evicted. A new claim writes its hash, with its lease, before
/// anything else (over a tombstone of another request, which it replaces;
/// an error later in the script leaves a claim that expires), and takes it
/// back when the scope is full: Redis refuses a script's first write that needs
/// room while memory is full (`noeviction`), and after any first write it
/// refuses none, so new claims fail closed only while `HSET` comes first. Expired entries are dropped from the count only when the
/// scope reads full (up to 4 batches of 64, while it still reads full), so
/// that a claim with room runs no search; a scope with no entries reads no
/// byte count (its records' bytes left with them).
///
/// `KEYS[1]` entry hash, `KEYS[2]` scope entries, `KEYS[3]` scope bytes;
/// `ARGV[1]` claim token, `ARGV[2]` fingerprint, `ARGV[3]` claim lease in
/// ms, `ARGV[4]` member (the entry's digest), `ARGV[5]` most entries,
/// `ARGV[6]` most bytes. Replies `{1}` claimed,
/// `{2, pttl}` in flight, `{3}` mismatch, `{4, record}` done, `{5, ms}`
/// over quota (time until the scope's oldest entry expires), `{6}` its
/// request already gave up.
pub(crate) const CLAIM_LUA: &str = concat!(
    idem_prelude!(),
    r#"local v = redis.call('HMGET', KEYS[1], 's', 't', 'f')
if v[1] == 'a' then
  if v[2] == ARGV[1] then return {6} end
  v = {}
end
if v[1] then
  if v[3] ~= ARGV[2] then return {3} end
  if v[1] == 'd' then return {4, redis.call('HGET', KEYS[1], 'r')} end
  if v[2] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4] .. ':0')
    keep(2, ARGV[3], false)
    return {1}
  end
  redis.pcall('HSET', KEYS[1], 'w', '1')
  return {2, redis.call('PTTL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 's', 'p', 't', ARGV[1], 'f', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local most, room = tonumber(ARGV[5]), tonumber(ARGV[6])
local held = redis.call('ZCARD', KEYS[2])
local bytes = 0
if held > 0 then bytes = tonumber(redis.call('GET', KEYS[3]) or '0') end
if held >= most or bytes >= room then
  for _ = 1, 4 do
    local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 64)
    if #gone == 0 then break end
    local freed = 0
    for i = 1, #gone do
      freed = freed + (tonumber(string.match(gone[i], ':(%d+)$')) or 0)
    end
    redis.call('ZREM', KEYS[2], unpack(gone))
    held = held - #gone
    if freed > 0 then
      bytes = redis.call('DECRBY', KEYS[3], freed)
      if bytes <= 0 then
        redis.call('DEL', KEYS[3])
        bytes = 0
      end
    end
    if #gone < 64 or (held < most and bytes < room) then break end
  end
  if held >= most or bytes >= room then
    local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    local wait = 1000
    if first[2] then wait = math.max(tonumber(first[2]) - now, 1) end
    redis.call('DEL', KEYS[1])
    return {5, wait}
  end
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4] .. ':0')
keep(2, ARGV[3], held == 0 and 'new' or true)
return {1}"#
);

/// Our claim becomes the record, kept for the retention, counted in its
/// scope, and is published on the entry's channel if a duplicate waits for
/// it (`w`). A member of the same digest and size already in the scope is
/// an expired record of the same key not yet swept, whose bytes are still
/// counted: they are not counted again (unless the count is gone). The publication is a `pcall`: a client whose ACL forbids
/// PUBLISH still records (its duplicates look at the store instead). A
/// re-sent completion finds our token on a done entry and succeeds again.
/// A claim that lapsed with nothing in its place (it expired while Redis
/// could not be reached to renew it, or a restart lost it; or only another
/// request's abandon mark is there, left while the key was free) is
/// recorded all the same, under the claim's fingerprint, and published to
/// any duplicate still waiting: the handler ran.
///
/// `KEYS` as [`CLAIM_LUA`]; `ARGV[1]` claim token, `ARGV[2]` sealed record,
/// `ARGV[3]` retention in ms, `ARGV[4]` member, `ARGV[5]` fingerprint.
/// Replies 1 recorded, 0 another's claim or record.
pub(crate) const COMPLETE_LUA: &str = concat!(
    allow_oom!(),
    idem_prelude!(),
    r#"local v = redis.call('HMGET', KEYS[1], 's', 't', 'w')
if not v[1] or (v[1] == 'a' and v[2] ~= ARGV[1]) then
  redis.call('HSET', KEYS[1], 't', ARGV[1], 'f', ARGV[5])
  v = {'p', ARGV[1], '1'}
end
if v[2] ~= ARGV[1] or v[1] == 'a' then return 0 end
if v[1] == 'p' then
  redis.call('HSET', KEYS[1], 's', 'd', 'r', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  local size = string.len(ARGV[2]) + string.len(KEYS[1])
  local found = redis.call('ZREM', KEYS[2], ARGV[4] .. ':0') == 1
  local added = redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4] .. ':' .. size)
  keep(2, ARGV[3], found)
  if added == 1 or redis.call('EXISTS', KEYS[3]) == 0 then
    local bytes = redis.call('INCRBY', KEYS[3], size)
    keep(3, ARGV[3], bytes == size and 'new' or true)
  else
    keep(3, ARGV[3], true)
  end
  if v[3] then redis.pcall('PUBLISH', KEYS[1], ARGV[2]) end
end
return 1"#
);

/// Push our claim's expiry out while its request runs, if it is still a
/// claim and still ours.
///
/// `KEYS` as [`CLAIM_LUA`]; `ARGV[1]` claim token, `ARGV[2]` lease in ms,
/// `ARGV[3]` member. Replies 1 extended, 0 not our claim (or already done).
pub(crate) const EXTEND_CLAIM_LUA: &str = concat!(
    allow_oom!(),
    idem_prelude!(),
    r#"local v = redis.call('HMGET', KEYS[1], 's', 't')
if v[1] == 'p' and v[2] == ARGV[1] then
  local added = redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3] .. ':0')
  keep(2, ARGV[2], added == 0)
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0"#
);

/// Delete our claim if it is still a claim, and its place in the scope;
/// tell a waiting duplicate (an empty message on the entry's channel, a
/// `pcall` like in [`COMPLETE_LUA`]). When there is no entry at all, our
/// claim may still be on its way (a command re-sent after a reconnect, or
/// sent on another connection of a pool): leave a tombstone (`s` = `a`
/// with our token, for a lease) that such a claim finds and obeys, so that
/// no claim outlives the request that gave up on it.
///
/// `KEYS` as [`CLAIM_LUA`]; `ARGV[1]` claim token, `ARGV[2]` member,
/// `ARGV[3]` lease in ms. Replies 1 deleted, 0 not our claim (or already
/// done, or not there yet).
pub(crate) const ABANDON_LUA: &str = r#"local v = redis.call('HMGET', KEYS[1], 's', 't', 'w')
if not v[1] then
  if redis.pcall('HSET', KEYS[1], 's', 'a', 't', ARGV[1]) == 2 then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
  end
  return 0
end
if v[1] == 'p' and v[2] == ARGV[1] then
  local n = redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2] .. ':0')
  if v[3] then redis.pcall('PUBLISH', KEYS[1], '') end
  return n
end
return 0"#;

/// [`ACQUIRE_LUA`], hashed once per process.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
/// [`ACQUIRE_FENCED_LUA`], hashed once per process.
pub(crate) static ACQUIRE_FENCED: LazyLock<Script> =
    LazyLock::new(|| Script::new(ACQUIRE_FENCED_LUA));
/// [`ACQUIRE_WAIT_LUA`], hashed once per process.
pub(crate) static ACQUIRE_WAIT: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_WAIT_LUA));
/// [`RELEASE_NOTIFY_LUA`], hashed once per process.
pub(crate) static RELEASE_NOTIFY: LazyLock<Script> =
    LazyLock::new(|| Script::new(RELEASE_NOTIFY_LUA));
/// [`RELEASE_LUA`], hashed once per process.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));
/// [`EXTEND_LUA`], hashed once per process.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));
/// [`BATCH_LUA`], hashed once per process.
pub(crate) static BATCH: LazyLock<Script> = LazyLock::new(|| Script::new(BATCH_LUA));
/// [`CLAIM_LUA`], hashed once per process.
pub(crate) static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(CLAIM_LUA));
/// [`COMPLETE_LUA`], hashed once per process.
pub(crate) static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));
/// [`EXTEND_CLAIM_LUA`], hashed once per process.
pub(crate) static EXTEND_CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_CLAIM_LUA));
/// [`ABANDON_LUA`], hashed once per process.
pub(crate) static ABANDON: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON_LUA));

/// A Lua script sent with `EVALSHA`, falling back to `EVAL` (which also caches
/// it on that server) when the server answers `NOSCRIPT` (restart, failover,
/// `SCRIPT FLUSH`, a cluster node that never saw it).
#[derive(Clone)]
pub(crate) struct Script {
    lua: &'static str,
    // Hashed once; a `Str` is reference-counted, so each call clones a
    // pointer instead of copying 40 bytes into a new buffer.
    sha: Str,
}

impl Script {
    /// `lua` and its SHA-1.
    pub(crate) fn new(lua: &'static str) -> Self {
        Self {
            lua,
            sha: Str::from(fred::util::sha1_hash(lua)),
        }
    }

    /// `EVALSHA` of this script on `client` with `keys` (one slot by
    /// construction) and `args`. Sent as a custom command, so that the
    /// options of a `WithOptions` client apply (fred 10.1's `LuaInterface`
    /// has no `WithOptions` form): the lane's batches, bounded by their
    /// flight, go with fred's per-command timer off. Same command, same
    /// reply.
    pub(crate) async fn evalsha<C: ClientLike>(
        &self,
        client: &C,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, FredError> {
        let command = script_command(client, "EVALSHA", &keys);
        let call = script_args(Value::from(self.sha.clone()), keys, args);
        client.custom::<Value, _>(command, call).await
    }

    /// `EVAL` of this script (which also caches it on that server): for a
    /// server that answered [`is_noscript`].
    pub(crate) async fn eval<C: ClientLike>(
        &self,
        client: &C,
        keys: Vec<Key>,
        args: Vec<Value>,
    ) -> Result<Value, FredError> {
        let command = script_command(client, "EVAL", &keys);
        let call = script_args(Value::from_static_str(self.lua), keys, args);
        client.custom::<Value, _>(command, call).await
    }
}

/// `EVALSHA` or `EVAL` as a custom command: on a cluster, routed by its
/// first key's slot (its keys share one slot by construction); elsewhere
/// the slot is not computed (fred ignores it there), as fred's own
/// `evalsha` does.
fn script_command<C: ClientLike>(client: &C, name: &'static str, keys: &[Key]) -> CustomCommand {
    let hasher = match keys.first() {
        Some(key) if client.is_clustered() => {
            ClusterHash::Custom(fred::util::redis_keyslot(key.as_bytes()))
        }
        _ => ClusterHash::Random,
    };
    CustomCommand::new_static(name, hasher, false)
}

/// `script numkeys key.. arg..`.
fn script_args(script: Value, keys: Vec<Key>, args: Vec<Value>) -> Vec<Value> {
    let mut call = Vec::with_capacity(2 + keys.len() + args.len());
    call.push(script);
    call.push(Value::Integer(keys.len() as i64));
    call.extend(keys.into_iter().map(Value::from));
    call.extend(args);
    call
}

/// The server does not have the script (restart, failover, `SCRIPT FLUSH`,
/// a cluster node that never saw it): send it again with `EVAL`.
pub(crate) fn is_noscript(e: &FredError) -> bool {
    e.details().starts_with("NOSCRIPT")
}

// ------------------------------------------------ arguments and replies

/// A fred error as a [`BackendError`] of the matching kind (timeouts,
/// protocol errors, lost or refused connections), with fred's as its source.
pub(crate) fn map_err(e: FredError) -> BackendError {
    // The server's refusals of work for now (loading, a replica, a script
    // running, no primary, a slot moving, out of memory): fred reads them
    // as `Unknown`.
    const FOR_NOW: [&str; 8] = [
        "OOM",
        "LOADING",
        "READONLY",
        "BUSY",
        "MASTERDOWN",
        "NOREPLICAS",
        "TRYAGAIN",
        "CLUSTERDOWN",
    ];
    let for_now = || {
        let first = e.details().split_whitespace().next().unwrap_or_default();
        FOR_NOW.contains(&first)
    };
    let kind = match e.kind() {
        ErrorKind::Timeout => BackendErrorKind::Timeout,
        ErrorKind::Unknown if for_now() => BackendErrorKind::Unavailable,
        ErrorKind::Protocol | ErrorKind::Parse => BackendErrorKind::Protocol,
        ErrorKind::IO
        | ErrorKind::Canceled
        | ErrorKind::Backpressure
        | ErrorKind::Routing
        | ErrorKind::Cluster
        | ErrorKind::Sentinel => BackendErrorKind::Unavailable,
        _ => BackendErrorKind::Other,
    };
    BackendError::with_kind(kind, "redis command failed").with_source(e)
}

/// An integer reply, also when it arrives as a string or bytes.
pub(crate) fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Integer(i) => Some(*i),
        Value::String(s) => s.parse().ok(),
        Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

/// A bulk string reply's bytes.
pub(crate) fn bytes_of(v: &Value) -> Option<bytes::Bytes> {
    match v {
        Value::Bytes(b) => Some(b.clone()),
        Value::String(s) => Some(bytes::Bytes::from(s.to_string())),
        _ => None,
    }
}

/// A compare-and-act reply: 1 done, 0 not ours.
pub(crate) fn flag(reply: &Value, what: &str) -> Result<bool, BackendError> {
    as_int(reply)
        .map(|n| n == 1)
        .ok_or_else(|| protocol(what, reply))
}

/// A reply to `what` that the script cannot have sent.
pub(crate) fn protocol(what: &str, v: &Value) -> BackendError {
    BackendError::with_kind(
        BackendErrorKind::Protocol,
        format!("unexpected reply to {what}: {v:?}"),
    )
}
