//! [`ReplayStore`] for [`RedisBackend`]: one hash per key,
//! `prefix:{digest}:idem`, so claim and record share a key (and a Cluster
//! slot). Fields: `s` state (`p` claimed, `d` done), `t` claim token, `f`
//! fingerprint, `r` encoded [`Record`]. Each step is one `EVALSHA`.

use std::sync::LazyLock;
use std::time::Duration;

use bytes::Bytes;
use fred::interfaces::LuaInterface;
use fred::types::{Key, Value};

use super::record::Record;
use super::store::{Claim, ReplayStore};
use crate::backend::redis::{as_int, map_err, protocol, token_value, ttl_ms, Script};
use crate::backend::{BackendError, BackendErrorKind, BackendFuture, Token};
use crate::RedisBackend;

/// Claim if absent (or ours: a re-sent command); else compare the
/// fingerprint and report in-flight (with PTTL) or the record, all in one
/// round trip. Replies: `{1}` claimed, `{2, pttl}` in flight, `{3}` mismatch,
/// `{4, record}` done.
const CLAIM_LUA: &str = r#"local v = redis.call('HMGET', KEYS[1], 's', 't', 'f')
if not v[1] then
  redis.call('HSET', KEYS[1], 's', 'p', 't', ARGV[1], 'f', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1}
end
if v[3] ~= ARGV[2] then return {3} end
if v[1] == 'p' then
  if v[2] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {1}
  end
  return {2, redis.call('PTTL', KEYS[1])}
end
return {4, redis.call('HGET', KEYS[1], 'r')}"#;

/// Our claim becomes the record, kept for the retention. A re-sent
/// completion finds our token on a done entry and succeeds again.
const COMPLETE_LUA: &str = r#"local v = redis.call('HMGET', KEYS[1], 's', 't')
if v[2] ~= ARGV[1] then return 0 end
if v[1] == 'p' then
  redis.call('HSET', KEYS[1], 's', 'd', 'r', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1"#;

/// Delete our claim if it is still a claim.
const ABANDON_LUA: &str = r#"local v = redis.call('HMGET', KEYS[1], 's', 't')
if v[1] == 'p' and v[2] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"#;

struct Scripts {
    claim: Script,
    complete: Script,
    abandon: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Script::new(CLAIM_LUA),
    complete: Script::new(COMPLETE_LUA),
    abandon: Script::new(ABANDON_LUA),
});

fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::Bytes(b) => Some(b.clone()),
        Value::String(s) => Some(Bytes::from(s.to_string())),
        _ => None,
    }
}

fn parse_claim(reply: &Value) -> Result<Claim, BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("claim", reply));
    };
    match items.first().and_then(as_int) {
        Some(1) => Ok(Claim::Claimed),
        Some(2) => Ok(Claim::InFlight {
            retry_after: items
                .get(1)
                .and_then(as_int)
                .filter(|ms| *ms >= 0)
                .map(|ms| Duration::from_millis(ms as u64)),
        }),
        Some(3) => Ok(Claim::Mismatch),
        Some(4) => {
            let data = items
                .get(1)
                .and_then(bytes_of)
                .ok_or_else(|| protocol("claim", reply))?;
            Record::decode(data).map(Claim::Done).map_err(|e| {
                BackendError::with_kind(BackendErrorKind::Protocol, "bad idempotency record")
                    .with_source(e)
            })
        }
        _ => Err(protocol("claim", reply)),
    }
}

impl<C> ReplayStore for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn claim(
        &self,
        key: &Bytes,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
    ) -> BackendFuture<Claim> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![
            token_value(token),
            Value::Bytes(Bytes::copy_from_slice(fingerprint)),
            ttl_ms(lease),
        ];
        Box::pin(async move {
            let reply = SCRIPTS
                .claim
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            parse_claim(&reply)
        })
    }

    fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![
            token_value(token),
            Value::Bytes(record.encode()),
            ttl_ms(retention),
        ];
        Box::pin(async move {
            let reply = SCRIPTS
                .complete
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("complete", &reply))
        })
    }

    fn abandon(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token)];
        Box::pin(async move {
            let reply = SCRIPTS
                .abandon
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("abandon", &reply))
        })
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}
