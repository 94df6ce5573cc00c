use super::*;
use std::time::Duration;

/// An entry that expires at `Some(at)`, or never.
#[derive(Debug, Clone, Copy, PartialEq)]
struct E(Option<Instant>);

impl Expiring for E {
    fn expires(&self) -> Option<Instant> {
        self.0
    }
}

const EVERY: usize = 16;

#[tokio::test(start_paused = true)]
async fn get_if_live_follows_the_clock() {
    let map = ExpiringMap::new(4, EVERY);
    let k = Bytes::from_static(b"k");
    let now = Instant::now();
    {
        let (mut shard, key) = map.lock(&k);
        shard.insert(key, E(Some(now + Duration::from_secs(1))));
        assert!(shard.live(key, now).is_some());
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    let later = Instant::now();
    let (mut shard, key) = map.lock(&k);
    assert!(shard.live(key, later).is_none(), "expired at its instant");
    assert!(shard.live_mut(key, later).is_none());
    assert!(shard.get(key).is_some(), "kept until removed or swept");
    assert_eq!(
        shard.remove(key),
        Some(E(Some(now + Duration::from_secs(1))))
    );
    assert!(shard.get(key).is_none());
    // An entry without an expiry is always live.
    shard.insert(key, E(None));
    assert!(shard.live(key, later + Duration::from_secs(3600)).is_some());
}

#[test]
fn the_sweep_is_paced_and_drops_only_expired_entries() {
    let now = Instant::now();
    let past = E(Some(now));
    let future = E(Some(now + Duration::from_secs(60)));
    let mut e = Entries::new(RandomState::new(), Some(EVERY));
    let keys: Vec<Bytes> = (0..4 * EVERY)
        .map(|i| Bytes::from(format!("k{i}")))
        .collect();
    // Below the threshold nothing is swept, however many writes.
    for k in &keys[..EVERY] {
        let key = e.key(k);
        e.insert_and_sweep(key, past, now);
    }
    assert_eq!(e.len(), EVERY, "not more than `EVERY` entries: no sweep");
    // Above it, the sweep runs on the `EVERY`th write and keeps what is
    // live or never expires.
    let pending = Bytes::from_static(b"pending");
    let live = Bytes::from_static(b"live");
    let (kp, kl) = (e.key(&pending), e.key(&live));
    e.insert_and_sweep(kp, E(None), now);
    e.insert_and_sweep(kl, future, now);
    for k in &keys[EVERY..2 * EVERY - 3] {
        let key = e.key(k);
        e.insert_and_sweep(key, past, now);
    }
    assert_eq!(e.len(), 2 * EVERY - 1, "one write short of the sweep");
    let key = e.key(&keys[2 * EVERY - 3]);
    e.insert_and_sweep(key, past, now);
    assert_eq!(
        e.len(),
        2,
        "swept: only the live and the pending entry stay"
    );
    assert_eq!(e.get(kp), Some(&E(None)));
    assert_eq!(e.get(kl), Some(&future));
    // A shard with the sweep off keeps everything.
    let mut off = Entries::new(RandomState::new(), None);
    for k in &keys {
        let key = off.key(k);
        off.insert_and_sweep(key, past, now);
    }
    assert_eq!(off.len(), keys.len());
}

#[test]
fn replacing_keeps_one_entry_and_keys_spread_over_shards() {
    let map = ExpiringMap::new(8, EVERY);
    let now = Instant::now();
    let k = Bytes::from_static(b"same");
    for i in 0..10 {
        let (mut shard, key) = map.lock(&k);
        shard.insert_and_sweep(key, E(Some(now + Duration::from_secs(i))), now);
    }
    assert_eq!(map.len(), 1);
    let (shard, key) = map.lock(&k);
    assert_eq!(shard.get(key), Some(&E(Some(now + Duration::from_secs(9)))));
    drop(shard);
    for i in 0..800 {
        let b = Bytes::from(format!("key{i}"));
        let (mut shard, key) = map.lock(&b);
        shard.insert_and_sweep(key, E(None), now);
    }
    let sizes: Vec<usize> = map.shards.iter().map(|s| lock(s).len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 801);
    assert!(sizes.iter().all(|&n| n > 50), "uneven shards: {sizes:?}");
}

#[test]
fn keys_are_found_by_content_even_when_hashes_collide() {
    let mut e = Entries::new(RandomState::new(), None);
    let now = Instant::now();
    let (a, b) = (Bytes::from_static(b"a"), Bytes::from_static(b"b"));
    let ka = e.key(&a);
    // Same hash, other bytes: a different key.
    let forged = Key {
        hash: ka.hash,
        bytes: &b,
    };
    e.insert(ka, E(None));
    e.insert(forged, E(Some(now)));
    assert_eq!(e.len(), 2);
    assert_eq!(e.get(ka), Some(&E(None)));
    assert_eq!(e.get(forged), Some(&E(Some(now))));
    assert_eq!(e.get(e.key(&b)), None, "b's real hash finds nothing");
}

/// A burst of keys gone gives its memory back, whether the keys were
/// removed (released) or swept (expired).
#[test]
fn a_burst_of_keys_gone_gives_its_room_back() {
    let now = Instant::now();
    let burst: Vec<Bytes> = (0..20_000).map(|i| Bytes::from(format!("b{i}"))).collect();
    // Removed.
    let mut e = Entries::new(RandomState::new(), Some(EVERY));
    for k in &burst {
        let key = e.key(k);
        e.insert(key, E(None));
    }
    assert!(e.map.capacity() >= 20_000);
    for k in &burst {
        let key = e.key(k);
        e.remove(key);
    }
    assert!(
        e.map.capacity() <= 4 * MIN_ROOM,
        "room for {} entries kept after all were removed",
        e.map.capacity()
    );
    // Swept.
    let mut e = Entries::new(RandomState::new(), Some(EVERY));
    for k in &burst {
        let key = e.key(k);
        e.insert(key, E(Some(now)));
    }
    let later = now + Duration::from_secs(1);
    for k in (0..EVERY).map(|i| Bytes::from(format!("after{i}"))) {
        let key = e.key(&k);
        e.insert_and_sweep(key, E(Some(later + Duration::from_secs(60))), later);
    }
    assert!(e.len() <= EVERY, "{} entries kept", e.len());
    assert!(
        e.map.capacity() <= 4 * MIN_ROOM,
        "room for {} entries kept after the sweep",
        e.map.capacity()
    );
}
