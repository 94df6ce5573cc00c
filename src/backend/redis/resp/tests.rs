//! The reply parser on hand-made, cut and random bytes.

use proptest::prelude::*;

use super::*;

fn value(bytes: &[u8]) -> Frame {
    match parse(bytes) {
        Ok(Some((reply, used))) => {
            assert_eq!(used, bytes.len(), "{bytes:?}");
            reply
        }
        other => panic!("{bytes:?}: {other:?}"),
    }
}

#[test]
fn replies_our_commands_get_parse() {
    assert_eq!(value(b"+OK\r\n"), Frame::Simple("OK".into()));
    assert_eq!(value(b":-3\r\n"), Frame::Integer(-3));
    assert_eq!(value(b"$-1\r\n"), Frame::Null);
    assert_eq!(value(b"$0\r\n\r\n"), Frame::Bulk(Bytes::new()));
    assert_eq!(
        value(b"$5\r\n\xff\x00\r\nx\r\n"),
        Frame::Bulk(Bytes::from_static(b"\xff\x00\r\nx"))
    );
    assert_eq!(
        value(b"-NOSCRIPT No matching script.\r\n"),
        Frame::Error("NOSCRIPT No matching script.".into())
    );
    // The batch script's reply: integers and the message of a failed pcall.
    assert_eq!(
        value(b"*3\r\n:1\r\n$9\r\nOOM full!\r\n:0\r\n"),
        Frame::Array(vec![
            Frame::Integer(1),
            Frame::Bulk(Bytes::from_static(b"OOM full!")),
            Frame::Integer(0)
        ])
    );
    assert_eq!(
        value(b"*2\r\n:1\r\n-ERR inner\r\n"),
        Frame::Array(vec![Frame::Integer(1), Frame::Error("ERR inner".into())])
    );
}

#[test]
fn every_prefix_of_a_reply_is_incomplete() {
    let whole: &[u8] = b"*4\r\n:1\r\n$3\r\nabc\r\n*1\r\n+x\r\n$-1\r\n";
    for cut in 0..whole.len() {
        assert_eq!(parse(&whole[..cut]), Ok(None), "cut at {cut}");
    }
    assert!(matches!(parse(whole), Ok(Some((_, n))) if n == whole.len()));
}

#[test]
fn malformed_replies_are_refused() {
    for bad in [
        &b"?x\r\n"[..],
        b"\r\n",
        b":12a\r\n",
        b":1\rx",
        b"$-2\r\n",
        b"$3\r\nabcd\r\n",
        b"*-5\r\n",
        b"$99999999999\r\n",
        b"*99999999999\r\n",
        b"*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        b"+\xff\r\n",
    ] {
        assert!(parse(bad).is_err(), "{bad:?}: {:?}", parse(bad));
    }
}

#[test]
fn a_line_without_end_is_refused_once_it_is_too_long() {
    let mut long = vec![b'+'];
    long.resize(70 * 1024, b'a');
    assert!(parse(&long).is_err());
    assert_eq!(parse(&long[..1000]), Ok(None));
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(Some((_, used))) = parse(&bytes) {
            prop_assert!(used <= bytes.len());
        }
    }

    #[test]
    fn reply_shaped_bytes_never_panic(parts in proptest::collection::vec(
        prop_oneof![
            Just(b"*".to_vec()), Just(b"$".to_vec()), Just(b":".to_vec()),
            Just(b"+".to_vec()), Just(b"-".to_vec()), Just(b"\r\n".to_vec()),
            Just(b"-1".to_vec()), Just(b"3".to_vec()), Just(b"0".to_vec()),
            Just(b"abc".to_vec()), Just(b"99999".to_vec()),
        ],
        0..24,
    )) {
        let bytes = parts.concat();
        if let Ok(Some((_, used))) = parse(&bytes) {
            prop_assert!(used <= bytes.len());
        }
    }

    #[test]
    fn encoded_integers_and_strings_read_back(n in any::<i64>(), s in "[a-z0-9 ]{0,40}") {
        let mut out = Vec::new();
        out.extend_from_slice(format!("*2\r\n:{n}\r\n").as_bytes());
        bulk(&mut out, s.as_bytes());
        prop_assert_eq!(
            value(&out),
            Frame::Array(vec![Frame::Integer(n), Frame::Bulk(Bytes::from(s.into_bytes()))])
        );
    }
}
