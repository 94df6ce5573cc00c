use super::*;

#[test]
fn the_pattern_covers_only_this_key_space() {
    assert_eq!(channel_pattern("trl"), "trl:{*:idem");
    assert_eq!(channel_pattern("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\:{*:idem");
    assert!(is_ours("trl", b"trl:{ab}:cd:idem"));
    for other in [
        &b"trl:{ab}:cd:idemx"[..],
        b"trlx:{ab}:cd:idem",
        b"other:{ab}:idem",
        b"trl:idem",
        b"trl:{",
    ] {
        assert!(!is_ours("trl", other), "{:?}", std::str::from_utf8(other));
    }
}
