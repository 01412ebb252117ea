//! The scripts: the Lua in `lua/` composed into one decision script and one operation
//! script, the arguments of a call, `EVALSHA` with its reload, and the reply.

use std::sync::LazyLock;

use redis::aio::ConnectionLike;
use redis::{RedisError, Script};
use smallvec::SmallVec;

use crate::algorithm::Algorithm;
use crate::{Decision, Decisions, Denial, Policy, StoreError, StoreErrorKind};

/// The algorithms, as every script has them after the prelude.
macro_rules! lua_algorithms {
    () => {
        concat!(
            include_str!("../../../lua/token_bucket.lua"),
            "\n",
            include_str!("../../../lua/gcra.lua"),
            "\n",
            include_str!("../../../lua/leaky_bucket.lua"),
            "\n",
            include_str!("../../../lua/fixed_window.lua"),
            "\n",
            include_str!("../../../lua/sliding_window_counter.lua"),
            "\n",
            include_str!("../../../lua/sliding_window_log.lua"),
            "\n",
            include_str!("../../../lua/concurrency.lua"),
        )
    };
}

/// The script that decides (and peeks): the prelude, every algorithm, and the entry that
/// decides all of a request's limits (see `lua/prelude.lua` for its keys, arguments and
/// reply).
const SOURCE: &str = concat!(
    include_str!("../../../lua/prelude.lua"),
    "\n",
    lua_algorithms!(),
    "\n",
    include_str!("../../../lua/check.lua"),
);

/// The script that charges, refunds and resets: the same with `lua/operate.lua` as its
/// entry.
const OPERATE_SOURCE: &str = concat!(
    include_str!("../../../lua/prelude.lua"),
    "\n",
    lua_algorithms!(),
    "\n",
    include_str!("../../../lua/operate.lua"),
);

/// The script that keeps a shared policy's ledger (see `store/share.rs`).
const SHARE_SOURCE: &str = include_str!("../../../lua/share.lua");

/// The scripts with their SHA-1s, computed once.
pub(super) static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(SOURCE));
static OPERATE: LazyLock<Script> = LazyLock::new(|| Script::new(OPERATE_SOURCE));
static SHARE: LazyLock<Script> = LazyLock::new(|| Script::new(SHARE_SOURCE));

/// `EVALSHA` of `script`, and on `NOSCRIPT` `EVAL` of its `source`, which also caches it
/// on that node. `command` makes either from the script's name and text.
///
/// `NOSCRIPT` comes after `SCRIPT FLUSH`, a restart or a failover, or from a cluster
/// node that never saw the script. The call goes to the node that owns the keys either
/// way.
async fn eval_cached(
    con: &mut impl ConnectionLike,
    script: &Script,
    source: &str,
    command: impl Fn(&str, &str) -> redis::Cmd,
) -> Result<redis::Value, RedisError> {
    match command("EVALSHA", script.get_hash()).query_async(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            command("EVAL", source).query_async(con).await
        }
        other => other,
    }
}

/// One call of the ledger script (see `lua/share.lua` for its arguments).
pub(super) struct ShareCall {
    pub(super) key: String,
    /// The caller's time in ms, or `None` for the server's `TIME`.
    pub(super) now_ms: Option<u64>,
    pub(super) terms: crate::share::Terms,
    pub(super) ask: crate::ShareAsk,
}

impl ShareCall {
    pub(super) async fn invoke(
        &self,
        con: &mut impl ConnectionLike,
    ) -> Result<redis::Value, RedisError> {
        use crate::share::{CHANGE_PART, MAX_HOLDERS, MIN_SIZE, RESERVE_PART, SIZE_PART};
        eval_cached(con, &SHARE, SHARE_SOURCE, |name, script| {
            let mut cmd = redis::cmd(name);
            cmd.arg(script).arg(1).arg(&self.key);
            match self.now_ms {
                Some(now) => cmd.arg(now),
                None => cmd.arg(""),
            };
            cmd.arg(self.terms.limit)
                .arg(self.terms.period_ms)
                .arg(self.terms.burst)
                .arg(self.ask.holder())
                .arg(self.ask.demand())
                .arg(self.ask.hold_ms())
                .arg(RESERVE_PART)
                .arg(SIZE_PART)
                .arg(MAX_HOLDERS)
                .arg(CHANGE_PART)
                .arg(MIN_SIZE);
            cmd
        })
        .await
    }
}

/// The share in a ledger script's reply.
pub(super) fn shared(reply: &[i64]) -> Result<crate::Share, StoreError> {
    match *reply {
        [rate, size, new, until] if rate >= 0 && size >= 0 && until >= 0 => Ok(crate::Share::new(
            rate as u64,
            size as u64,
            new == 1,
            until as u64,
        )),
        _ => Err(StoreError::new(
            StoreErrorKind::Script,
            "the share script replied no share: is another version of tollway using the same prefix?",
        )),
    }
}

/// The script's code for an algorithm (`ARGV` of each limit).
pub(super) fn code(algorithm: Algorithm) -> u64 {
    match algorithm {
        Algorithm::TokenBucket => 1,
        Algorithm::LeakyBucket => 2,
        Algorithm::LeakyBucketShaper => 3,
        Algorithm::FixedWindow => 4,
        Algorithm::SlidingWindowLog => 5,
        Algorithm::SlidingWindowCounter => 6,
        Algorithm::Gcra => 7,
        Algorithm::Concurrency => 8,
    }
}

/// The script's code for a fixed window of a calendar, whose numbers are its window's
/// start and end and the next one's end.
pub(super) const CALENDAR_WINDOW: u64 = 9;

/// One script call: its keys and arguments (see `lua/prelude.lua`).
pub(super) struct Call {
    pub(super) keys: SmallVec<[String; 2]>,
    pub(super) time: Time,
    pub(super) kind: Kind,
    /// The request's cost, or the units to charge or refund.
    pub(super) units: u64,
    pub(super) grace_ms: u64,
    /// Per limit: algorithm code, limit, period (µs), burst, emission interval (µs).
    pub(super) limits: SmallVec<[[u64; 5]; 2]>,
    /// One number a limit after the limits: a give-back's windows' ends, or a
    /// `CheckEach`'s costs (empty otherwise).
    pub(super) extra: SmallVec<[u64; 2]>,
}

/// Where a call's time comes from.
pub(super) enum Time {
    /// The caller's clock read this instant, in µs.
    Caller(u64),
    /// The server's `TIME`.
    Server,
    /// The server's `TIME`, replied after the decisions (the conformance suites').
    #[cfg(feature = "testing")]
    ServerTold,
}

/// Which script a call runs, and how.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    /// `check.lua`, writing the new states.
    Check,
    /// `check.lua` with a cost a limit, the call's `extra`.
    CheckEach,
    /// `check.lua`, writing nothing.
    Peek,
    /// `operate.lua`, with its operation's name.
    Operate(&'static str),
    /// `operate.lua`'s `lend`: a request of `cost`, and up to the call's units in all.
    Lend {
        /// The request's own cost.
        cost: u64,
    },
    /// `operate.lua`'s `giveback`: the call's units back to the windows ending at the
    /// call's `ends`. Never sent twice.
    GiveBack,
}

impl Kind {
    /// Whether the call may be sent again when its connection broke before the reply:
    /// not a give-back, which may have run, and must not free its units twice.
    pub(super) fn may_repeat(self) -> bool {
        !matches!(self, Kind::GiveBack)
    }
}

impl Call {
    /// `EVALSHA`, and on `NOSCRIPT` `EVAL` of the source, which also caches it on that
    /// node.
    ///
    /// `NOSCRIPT` comes after `SCRIPT FLUSH`, a restart or a failover, or from a cluster
    /// node that never saw the script. The call goes to the node that owns the keys
    /// either way.
    pub(super) async fn invoke(
        &self,
        con: &mut impl ConnectionLike,
    ) -> Result<redis::Value, RedisError> {
        let (script, source) = match self.kind {
            Kind::Check | Kind::CheckEach | Kind::Peek => (&*SCRIPT, SOURCE),
            Kind::Operate(_) | Kind::Lend { .. } | Kind::GiveBack => (&*OPERATE, OPERATE_SOURCE),
        };
        eval_cached(con, script, source, |name, script| {
            self.command(name, script)
        })
        .await
    }

    fn command(&self, name: &str, script: &str) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(script).arg(self.keys.len()).arg(&self.keys[..]);
        match self.time {
            Time::Caller(now) => cmd.arg(now),
            Time::Server => cmd.arg(""),
            #[cfg(feature = "testing")]
            Time::ServerTold => cmd.arg("TIME"),
        };
        match self.kind {
            Kind::CheckEach => cmd.arg("*"),
            _ => cmd.arg(exact(self.units)),
        };
        match self.kind {
            Kind::Peek => cmd.arg("peek"),
            Kind::Check
            | Kind::CheckEach
            | Kind::Operate(_)
            | Kind::Lend { .. }
            | Kind::GiveBack => cmd.arg(self.grace_ms),
        };
        for limit in &self.limits {
            cmd.arg(&limit[..]);
        }
        match self.kind {
            Kind::Operate(operation) => cmd.arg(operation),
            Kind::Lend { cost } => cmd.arg("lend").arg(exact(cost)),
            Kind::GiveBack => cmd.arg("giveback").arg(&self.extra[..]),
            Kind::CheckEach => cmd.arg(&self.extra[..]),
            Kind::Check | Kind::Peek => &mut cmd,
        };
        cmd
    }
}

/// `units` as a script reads them exactly: a number past 2^53 (past every capacity, and
/// past what Lua's doubles hold exactly) as 2^53 + 2, which is as far past every
/// capacity and exact. A cost, charge, refund or drain past every capacity does what
/// one just past them does.
pub(super) fn exact(units: u64) -> u64 {
    units.min(crate::MAX_UNITS + 2)
}

/// What each limit can hold: the capacity a reply's decisions report.
pub(super) fn capacities(policies: &[&Policy]) -> SmallVec<[u64; 2]> {
    policies.iter().map(|p| p.quota().burst()).collect()
}

/// The decisions in a script's reply: four integers a limit, `{ denial, remaining,
/// reset_after_us, wait_us }`, for limits of the given capacities.
pub(super) fn parse(reply: &[i64], capacities: &[u64]) -> Result<Decisions, StoreError> {
    let bad = || {
        StoreError::new(
            StoreErrorKind::Script,
            format!(
                "Redis script replied {reply:?}, not {} decisions: is another version of tollway using the same prefix?",
                capacities.len()
            ),
        )
    };
    if reply.len() != 4 * capacities.len() {
        return Err(bad());
    }
    reply
        .chunks_exact(4)
        .zip(capacities)
        .map(|(fields, &limit)| {
            let field = |i: usize| u64::try_from(fields[i]).map_err(|_| bad());
            let (remaining, reset, wait) = (field(1)?, field(2)?, field(3)?);
            match fields[0] {
                0 => Ok(Decision::allow(limit, remaining, reset, wait)),
                1 if wait > 0 => Ok(Decision::limited(limit, remaining, reset, wait)),
                2 if wait == 0 => Ok(Decision::refused(
                    Denial::CostExceedsCapacity,
                    limit,
                    remaining,
                    reset,
                )),
                _ => Err(bad()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_has_its_own_code() {
        let codes: std::collections::HashSet<_> = Algorithm::ALL.iter().map(|a| code(*a)).collect();
        assert_eq!(codes.len(), Algorithm::ALL.len());
    }

    #[test]
    fn replies_parse_into_decisions_or_are_refused() {
        let d = parse(&[0, 4, 100, 0, 1, 0, 60, 20, 2, 7, 0, 0], &[5, 1, 9]).unwrap();
        assert!(d[0].is_allowed() && d[0].remaining() == 4 && d[0].limit() == 5);
        assert_eq!(d[1].denial(), Some(Denial::Limited));
        assert_eq!(d[1].retry_after_micros(), 20);
        assert_eq!(d[2].denial(), Some(Denial::CostExceedsCapacity));
        // Wrong length, a negative field, a limited decision without a wait, a
        // refusal with one, an unknown code.
        for (reply, limits) in [
            (&[0, 1, 2][..], &[1][..]),
            (&[0, -1, 0, 0], &[1]),
            (&[1, 0, 5, 0], &[1]),
            (&[2, 0, 5, 3], &[1]),
            (&[9, 0, 0, 0], &[1]),
        ] {
            let err = parse(reply, limits).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::Script, "{reply:?}");
        }
    }
}
