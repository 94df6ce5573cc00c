use super::*;
use fred::error::ErrorKind;
use fred::interfaces::ClientLike;

#[test]
fn a_server_without_set_nx_get_is_told_which_version_to_run() {
    let old = FredError::new(
        ErrorKind::Unknown,
        "ERR Error running script (call to f_0123): @user_script:1: ERR syntax error",
    );
    let error = acquire_err(old);
    assert!(error.to_string().contains("Redis >= 7.0"), "{error}");
    let other = acquire_err(FredError::new(ErrorKind::IO, "connection reset"));
    assert_eq!(other.kind, BackendErrorKind::Unavailable);
}

#[test]
fn acquire_replies_parse() {
    assert!(matches!(
        parse_acquire(&Value::Integer(scripts::ACQUIRED), false),
        Ok(Acquire::Acquired { fence: None, .. })
    ));
    assert!(matches!(
        parse_acquire(&Value::Integer(1500), false),
        Ok(Acquire::Held { retry_after: Some(d) }) if d == Duration::from_millis(1500)
    ));
    assert!(matches!(
        parse_acquire(&Value::Integer(-1), false),
        Ok(Acquire::Held { retry_after: None })
    ));
    assert!(parse_acquire(&Value::Integer(-2), false).is_err());
    assert!(parse_acquire(&Value::Null, false).is_err());
}

/// A native lease call on its way holds a small future (its fred commands
/// are boxed: each is several KiB): a thousand of them while Redis hangs
/// must not cost tens of MiB.
#[test]
fn a_native_call_on_its_way_is_small() {
    let client = fred::clients::Client::default().with_options(&Default::default());
    let key = Bytes::from_static(b"k");
    let ttl = Duration::from_secs(1);
    for job in [
        Job::acquire(&key, [b'a'; 32], ttl, false),
        Job::release(&key, [b'a'; 32], false),
        Job::extend(&key, [b'a'; 32], ttl),
    ] {
        let gone = std::sync::atomic::AtomicBool::new(false);
        let call = native::send(&job, &client, true, &gone);
        assert!(std::mem::size_of_val(&call) <= 1024, "{job:?}");
    }
}

/// What Redis 7.0.15 and Valkey 9.1.2 answer, inside a script, to a
/// `DELIFEQ` they lack or refuse (each read from the server here), against
/// the errors a release may get that are not a refusal.
#[test]
fn a_refused_delifeq_inside_a_script_is_told_apart() {
    for refused in [
        "ERR Unknown Redis command called from script",
        "ERR Unknown command called from script",
        "ERR ACL failure in script: User lim has no permissions to run the 'delifeq' command",
    ] {
        assert!(native::refused_in_script(refused), "{refused}");
    }
    for failed in [
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "error in the batch script",
    ] {
        assert!(!native::refused_in_script(failed), "{failed}");
    }
}

/// A TTL sent to Redis is rounded up to whole milliseconds: the lease in
/// Redis never ends before the one the process counts from the same TTL
/// (its deadline, its local table), which another instance could use.
#[test]
fn a_ttl_is_rounded_up_to_whole_milliseconds() {
    assert_eq!(ttl_millis(Duration::from_micros(1_900)), 2);
    assert_eq!(ttl_millis(Duration::from_millis(3)), 3);
    assert_eq!(ttl_millis(Duration::from_nanos(1)), 1);
    assert_eq!(ttl_millis(Duration::ZERO), 1);
    assert_eq!(
        ttl_millis(Duration::MAX),
        crate::settings::MAX_DURATION.as_millis() as i64
    );
}

/// The server's refusals of work for now are `Unavailable` (an outage, not
/// an answer): fred reads them as `Unknown`. A record refused that way is
/// tried again whole, never replaced by its not-stored marker.
#[test]
fn the_servers_refusals_for_now_are_unavailable() {
    for reply in [
        "LOADING Redis is loading the dataset in memory",
        "READONLY You can't write against a read only replica.",
        "BUSY Redis is busy running a script.",
        "OOM command not allowed when used memory > 'maxmemory'.",
    ] {
        let e = map_err(FredError::new(ErrorKind::Unknown, reply));
        assert_eq!(e.kind, BackendErrorKind::Unavailable, "{reply}");
    }
    let e = map_err(FredError::new(ErrorKind::Unknown, "ERR value is too large"));
    assert_eq!(e.kind, BackendErrorKind::Other);
}
