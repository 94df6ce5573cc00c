use std::sync::Arc;

use bytes::Bytes;

use super::*;

fn key(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[test]
fn a_release_here_is_one_bump_and_its_echo_none() {
    let w = Arc::new(Watchers::default());
    let (watch, first) = w.watch(&key("k"));
    assert!(first);
    let before = watch.count();
    let token = Token::from_bytes([
        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd,
        0xef,
    ]);
    assert_eq!(&token.to_hex(), b"0123456789abcdef0123456789abcdef");
    w.releasing(b"k", &token);
    w.released(b"k");
    assert_eq!(watch.count(), before + 1);
    // The echo of our own release: no second bump.
    w.heard(b"k", b"0123456789abcdef");
    assert_eq!(watch.count(), before + 1);
    // Another instance's release: one bump.
    w.heard(b"k", b"fedcba9876543210");
    assert_eq!(watch.count(), before + 2);
    // A probe, or a message of the wrong shape: nothing.
    w.heard(b"k", b"");
    w.heard(b"k", b"not a tag");
    assert_eq!(watch.count(), before + 2);
    // Keys nobody watches: nothing, and no slot appears.
    w.released(b"other");
    w.heard(b"other", b"fedcba9876543210");
    assert!(!w.is_watched(b"other"));
}

#[test]
fn the_last_watch_to_go_leaves_and_says_so_once() {
    let (tx, mut told) = tokio::sync::mpsc::unbounded_channel();
    let idle = |told: &mut tokio::sync::mpsc::UnboundedReceiver<Subscription>| {
        let mut n = 0;
        while let Ok(order) = told.try_recv() {
            assert!(matches!(order, Subscription::Unsubscribe(k) if k == key("k")));
            n += 1;
        }
        n
    };
    let w = Arc::new(Watchers::with_subscriber(tx));
    let (a, first_a) = w.watch(&key("k"));
    let (b, first_b) = w.watch(&key("k"));
    assert!(first_a && !first_b);
    drop(a);
    assert!(w.is_watched(b"k"));
    assert_eq!(idle(&mut told), 0);
    drop(b);
    assert!(!w.is_watched(b"k"));
    assert_eq!(idle(&mut told), 1);
}

#[test]
fn a_closed_slot_ends_its_watches_and_an_old_watch_never_leaves_a_new_slot() {
    let w = Arc::new(Watchers::default());
    let (old, _) = w.watch(&key("k"));
    assert!(old.is_live());
    w.close_all();
    assert!(!old.is_live());
    let (new, first) = w.watch(&key("k"));
    assert!(first);
    drop(old);
    assert!(w.is_watched(b"k"), "the old watch left the new slot");
    drop(new);
    assert!(!w.is_watched(b"k"));
}

#[test]
fn bump_all_wakes_every_key() {
    let w = Arc::new(Watchers::default());
    let (a, _) = w.watch(&key("a"));
    let (b, _) = w.watch(&key("b"));
    let (na, nb) = (a.count(), b.count());
    w.bump_all();
    assert_eq!((a.count(), b.count()), (na + 1, nb + 1));
}
