use std::sync::Arc;

use bytes::Bytes;
use tower_redis_lock::backend::contract::{EntryKey, Token};
use tower_redis_lock::key::KeySpace;

use super::*;
use crate::adapter::{Ask, Fate, Hold, Look, Marked, Recorded, Step};
use crate::open_count::OpenCount;

/// A stand-in for a database whose `COMMIT` answers at once and whose
/// unlock after it (`unhold`) takes `UNHOLD`: what a SQLite `DELETE`
/// queued behind another writer's lock, or a network stall after the
/// `COMMIT` reply, look like to the protocol. A mock: that moment cannot be
/// produced on a real database without a race. Only `commit`, `unhold`
/// and `release` are called by [`commit`].
struct SlowUnhold;

const UNHOLD: Duration = Duration::from_millis(400);

impl Adapter for SlowUnhold {
    type Conn = ();
    type Marker = ();
    const NAME: &'static str = "slow-unhold";
    const HOLD: Hold = Hold::Session;

    fn connect(&self) -> Step<'_, ()> {
        unreachable!()
    }
    fn release(_: ()) {}
    fn migrate(&self) -> Step<'_, ()> {
        unreachable!()
    }
    fn look<'a>(_: &'a mut (), _: &'a Ask, _: i64) -> Step<'a, Look> {
        unreachable!()
    }
    fn hold<'a>(_: &'a mut (), _: &'a Ask, _: i64) -> Step<'a, bool> {
        unreachable!()
    }
    fn wait<'a>(_: &'a mut (), _: &'a Ask, _: Duration) -> Step<'a, bool> {
        unreachable!()
    }
    fn unhold<'a>(_: &'a mut (), _: &'a [u8], _: &'a Token) -> Step<'a, ()> {
        Box::pin(async {
            tokio::time::sleep(UNHOLD).await;
            Ok(())
        })
    }
    fn begin<'a>(_: &'a mut (), _: Option<&'a str>) -> Step<'a, ()> {
        unreachable!()
    }
    fn mark<'a>(_: &'a mut (), _: &'a Ask, _: i64) -> Step<'a, Marked<()>> {
        unreachable!()
    }
    fn record<'a>(
        _: &'a mut (),
        _: &'a [u8],
        _: &'a Token,
        _: &'a [u8],
        _: (i64, i64),
        _: &'a (),
    ) -> Step<'a, Recorded> {
        unreachable!()
    }
    fn fate<'a>(_: &'a mut (), _: &'a ()) -> Step<'a, Fate> {
        unreachable!()
    }
    fn end<'a>(_: &'a mut (), _: &'a Ask, _: i64) -> Step<'a, ()> {
        unreachable!()
    }
    fn outcome<'a>(&'a self, _: &'a ()) -> Step<'a, Option<bool>> {
        unreachable!()
    }
    fn commit(_: &mut ()) -> Step<'_, Committed> {
        Box::pin(std::future::ready(Ok(Committed::Yes)))
    }
    fn rollback(_: &mut ()) -> Step<'_, ()> {
        unreachable!()
    }
    fn finalize<'a>(_: &'a mut (), _: &'a Ask, _: &'a [u8], _: (i64, i64)) -> Step<'a, ()> {
        unreachable!()
    }
    fn recorded<'a>(_: &'a mut (), _: &'a [u8], _: &'a Token, _: i64) -> Step<'a, bool> {
        unreachable!()
    }
    fn extend<'a>(_: &'a mut (), _: &'a [u8], _: &'a Token, _: (i64, i64)) -> Step<'a, bool> {
        unreachable!()
    }
    fn sweep(_: &mut (), _: i64, _: i64) -> Step<'_, u64> {
        unreachable!()
    }
}

/// A `COMMIT` that answered within the commit timeout is a commit, however
/// long the unlock after it takes: the client is told what happened, not
/// that it cannot be known.
#[tokio::test(start_paused = true)]
async fn a_commit_that_answered_is_a_commit_however_long_the_unlock_takes() {
    let mut scope = KeySpace::default().writer();
    scope.push("scope", b"commit-tests");
    let mut name = KeySpace::default().writer();
    name.push("entry", b"slow-unhold");
    let key = EntryKey::new(&KeySpace::default(), &scope.finish(), &name.finish());
    let count = OpenCount::new();
    let open = Open::<SlowUnhold> {
        ask: Ask {
            key,
            token: Token::generate(),
            fp: Bytes::from_static(b"fp"),
            lease: Duration::from_secs(10),
            max_entries: 1_000,
            max_bytes: 1 << 30,
            retention: Duration::from_secs(60),
        },
        expires: Instant::now() + Duration::from_secs(10),
        marker: (),
        ended: false,
        conn: Arc::default(),
        _counted: count.open(),
    };
    let bound = UNHOLD / 4;
    let committed = commit(&SlowUnhold, (), open, bound).await;
    assert!(
        matches!(committed, Ok(true)),
        "answered within {bound:?}: {committed:?}"
    );
}
