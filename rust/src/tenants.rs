//! Tenants: who a request counts for (by its API key) and the limits of each: requests per
//! minute, tokens per minute, requests at once and a daily token budget, with the priority its
//! requests queue at. The control plane loads them from the tenants file (and reloads it); a
//! request's pass is taken at admission and settled when the request ends, its token count
//! corrected from the node's `usage`.
//!
//! Rates are token buckets: a bucket holds a minute's allowance and refills continuously, so
//! `remaining` and `reset` mean what `OpenAI`'s `x-ratelimit-*` headers say. Replicas sharing a
//! Redis registry debit each other's use into their buckets (`absorb`), once per sync.

mod usage;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use http::header::{HeaderName, HeaderValue};

pub(crate) use usage::{estimate_tokens, UsageMeter};

/// Whose request it is, as the queue orders it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Class {
    /// Served first when smaller (vLLM's `priority`); 0 unless the request or its key says.
    pub priority: i32,
    /// The tenant the request counts for; 0 for requests of no tenant.
    pub tenant: u32,
}

/// A tenant's limits; `None`: unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) rpm: Option<u64>,
    pub(crate) tpm: Option<u64>,
    pub(crate) concurrency: Option<u32>,
    pub(crate) daily_tokens: Option<u64>,
    /// The priority of its requests when they do not ask (smaller is served first).
    pub(crate) priority: i32,
    /// The most urgent priority its requests may ask for.
    pub(crate) priority_limit: i32,
}

/// One tenant as the tenants file describes it.
#[derive(Debug, Clone)]
pub(crate) struct TenantSpec {
    pub(crate) name: String,
    pub(crate) keys: Vec<String>,
    pub(crate) limits: Limits,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Limit {
    Requests,
    Tokens,
    Concurrency,
    Budget,
}

impl Limit {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokens => "tokens",
            Limit::Concurrency => "concurrency",
            Limit::Budget => "budget",
        }
    }
}

/// A refusal: the limit, when to retry, the headers of the answer.
#[derive(Debug, Clone)]
pub(crate) struct Limited {
    pub(crate) limit: Limit,
    pub(crate) message: String,
    pub(crate) retry_after: u32,
    pub(crate) headers: RateHeaders,
}

/// Counts per tenant, for `/metrics` and `/usage`.
#[derive(Debug, Default)]
pub(crate) struct TenantStats {
    pub(crate) requests: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) completion_tokens: AtomicU64,
    /// Requests whose tokens were estimated (the node reported no `usage`).
    pub(crate) estimated: AtomicU64,
    pub(crate) rejected: [AtomicU64; 4],
}

#[derive(Debug)]
pub(crate) struct Tenant {
    /// Stable for the process (kept across reloads): the queue's fairness key.
    pub(crate) id: u32,
    pub(crate) name: String,
    limits: Mutex<Limits>,
    meters: Mutex<Meters>,
    pub(crate) in_flight: AtomicU32,
    pub(crate) stats: TenantStats,
    /// What this process used since the last `take_local` (for the replicas' sync).
    unsynced: Mutex<(u64, u64)>,
}

#[derive(Debug)]
struct Meters {
    requests: Bucket,
    tokens: Bucket,
    /// The UTC day `today` counts, as days since the epoch.
    day: u64,
    /// Tokens used today, here and (synced) by other replicas.
    today: u64,
}

/// A minute's allowance, refilled continuously.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    updated: Instant,
}

impl Bucket {
    fn full(capacity: Option<u64>, now: Instant) -> Self {
        #[allow(clippy::cast_precision_loss)]
        Self { level: capacity.unwrap_or(0) as f64, updated: now }
    }

    fn refill(&mut self, capacity: u64, now: Instant) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let capacity = capacity as f64;
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + elapsed * capacity / 60.0).min(capacity);
        self.updated = now;
        capacity
    }

    /// Seconds until the bucket holds `wanted`.
    fn wait_for(&self, capacity: f64, wanted: f64) -> f64 {
        if self.level >= wanted || capacity <= 0.0 {
            0.0
        } else {
            (wanted - self.level) * 60.0 / capacity
        }
    }
}

/// `x-ratelimit-*` values at admission.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RateHeaders {
    /// Limit, remaining, seconds to full.
    pub(crate) requests: Option<(u64, u64, f64)>,
    pub(crate) tokens: Option<(u64, u64, f64)>,
}

/// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`.
static HEADER_NAMES: [[HeaderName; 3]; 2] = [
    [
        HeaderName::from_static("x-ratelimit-limit-requests"),
        HeaderName::from_static("x-ratelimit-remaining-requests"),
        HeaderName::from_static("x-ratelimit-reset-requests"),
    ],
    [
        HeaderName::from_static("x-ratelimit-limit-tokens"),
        HeaderName::from_static("x-ratelimit-remaining-tokens"),
        HeaderName::from_static("x-ratelimit-reset-tokens"),
    ],
];

impl RateHeaders {
    /// The headers of the answer (`OpenAI`'s names and formats).
    pub(crate) fn to_headers(self) -> impl Iterator<Item = (HeaderName, HeaderValue)> {
        [self.requests, self.tokens].into_iter().zip(&HEADER_NAMES).flat_map(|(values, names)| {
            values.into_iter().flat_map(move |(limit, remaining, reset)| {
                let values = [HeaderValue::from(limit), HeaderValue::from(remaining), duration_text(reset)];
                names.iter().cloned().zip(values)
            })
        })
    }
}

/// A duration as `OpenAI` writes resets: `20ms`, `1.5s`, `6m0s` (to the millisecond, up).
pub(crate) fn duration_text(seconds: f64) -> HeaderValue {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ms = (seconds.max(0.0) * 1000.0).ceil() as u64;
    let mut out = Vec::with_capacity(16);
    if ms < 1000 {
        push_number(&mut out, ms);
        out.extend_from_slice(b"ms");
    } else {
        let (minutes, rest) = (ms / 60_000, ms % 60_000);
        if minutes > 0 {
            push_number(&mut out, minutes);
            out.push(b'm');
        }
        push_number(&mut out, rest / 1000);
        let mut fraction = rest % 1000;
        if fraction > 0 {
            out.push(b'.');
            let mut digits = 3;
            while fraction % 10 == 0 {
                fraction /= 10;
                digits -= 1;
            }
            let start = out.len();
            push_number(&mut out, fraction);
            let written = out.len() - start;
            // Leading zeros of the fraction (5 ms: .005).
            for _ in written..digits {
                out.insert(start, b'0');
            }
        }
        out.push(b's');
    }
    HeaderValue::from_maybe_shared(bytes::Bytes::from(out)).unwrap_or_else(|_| HeaderValue::from_static("0s"))
}

fn push_number(out: &mut Vec<u8>, mut n: u64) {
    let start = out.len();
    loop {
        #[allow(clippy::cast_possible_truncation)]
        out.push(b'0' + (n % 10) as u8);
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out[start..].reverse();
}

fn utc_day() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() / 86_400
}

fn seconds_to_midnight() -> u32 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    u32::try_from(86_400 - now % 86_400).unwrap_or(86_400)
}

impl Tenant {
    fn new(id: u32, name: String, limits: Limits) -> Self {
        let now = Instant::now();
        Self {
            id,
            name,
            limits: Mutex::new(limits),
            meters: Mutex::new(Meters {
                requests: Bucket::full(limits.rpm, now),
                tokens: Bucket::full(limits.tpm, now),
                day: utc_day(),
                today: 0,
            }),
            in_flight: AtomicU32::new(0),
            stats: TenantStats::default(),
            unsynced: Mutex::new((0, 0)),
        }
    }

    pub(crate) fn limits(&self) -> Limits {
        *lock(&self.limits)
    }

    fn meters(&self) -> MutexGuard<'_, Meters> {
        let mut meters = lock(&self.meters);
        let day = utc_day();
        if meters.day != day {
            meters.day = day;
            meters.today = 0;
        }
        meters
    }

    /// The priority a request runs at: the one it asked for, bounded by the tenant's limit,
    /// else the tenant's own.
    pub(crate) fn priority(&self, asked: Option<i32>) -> i32 {
        let limits = self.limits();
        asked.map_or(limits.priority, |p| p.max(limits.priority_limit))
    }

    /// Admits a request estimated at `tokens` tokens, or says which limit it is over.
    pub(crate) fn admit(self: &Arc<Self>, tokens: u64, priority: Option<i32>) -> Result<TenantPass, Box<Limited>> {
        let limits = self.limits();
        let now = Instant::now();
        let mut meters = self.meters();
        let mut refused: Option<(Limit, f64, String)> = None;
        if let Some(budget) = limits.daily_tokens {
            if meters.today >= budget {
                let message = format!("tenant {} has used its daily budget of {budget} tokens", self.name);
                refused = Some((Limit::Budget, f64::from(seconds_to_midnight()), message));
            }
        }
        if refused.is_none() {
            if let Some(rpm) = limits.rpm {
                let capacity = meters.requests.refill(rpm, now);
                if meters.requests.level < 1.0 {
                    let wait = meters.requests.wait_for(capacity, 1.0);
                    let message = format!("tenant {} is over its limit of {rpm} requests per minute", self.name);
                    refused = Some((Limit::Requests, wait, message));
                }
            }
        }
        if refused.is_none() {
            if let Some(tpm) = limits.tpm {
                let capacity = meters.tokens.refill(tpm, now);
                // A request larger than the whole allowance waits for a full bucket, not forever.
                #[allow(clippy::cast_precision_loss)]
                let wanted = (tokens as f64).min(capacity);
                if meters.tokens.level < wanted || meters.tokens.level <= 0.0 {
                    let wait = meters.tokens.wait_for(capacity, wanted.max(1.0));
                    let message = format!("tenant {} is over its limit of {tpm} tokens per minute", self.name);
                    refused = Some((Limit::Tokens, wait, message));
                }
            }
        }
        if refused.is_none() {
            if let Some(cap) = limits.concurrency {
                let taken =
                    self.in_flight.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1));
                if taken.is_err() {
                    let message = format!("tenant {} already has {cap} requests in flight", self.name);
                    refused = Some((Limit::Concurrency, 1.0, message));
                }
            } else {
                self.in_flight.fetch_add(1, Ordering::AcqRel);
            }
        }
        if let Some((limit, wait, message)) = refused {
            self.stats.rejected[limit as usize].fetch_add(1, Ordering::Relaxed);
            let headers = headers_of(&limits, &mut meters, now);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let retry_after = wait.ceil().clamp(1.0, 86_400.0) as u32;
            return Err(Box::new(Limited { limit, message, retry_after, headers }));
        }
        if limits.rpm.is_some() {
            meters.requests.level -= 1.0;
        }
        #[allow(clippy::cast_precision_loss)]
        if limits.tpm.is_some() {
            meters.tokens.level -= tokens as f64;
        }
        meters.today += tokens;
        let headers = headers_of(&limits, &mut meters, now);
        drop(meters);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        lock(&self.unsynced).0 += 1;
        let class = Class { priority: self.priority(priority), tenant: self.id };
        Ok(TenantPass {
            tenant: Arc::clone(self),
            estimate: tokens,
            meter: UsageMeter::default(),
            failed: false,
            class,
            headers,
        })
    }

    /// Corrects the token meters once a request's real count is known.
    fn settle(&self, estimate: u64, used: u64) {
        let limits = self.limits();
        let mut meters = self.meters();
        #[allow(clippy::cast_precision_loss)]
        if let Some(tpm) = limits.tpm {
            meters.tokens.refill(tpm, Instant::now());
            meters.tokens.level = (meters.tokens.level + estimate as f64 - used as f64).min(tpm as f64);
        }
        meters.today = (meters.today + used).saturating_sub(estimate);
        drop(meters);
        lock(&self.unsynced).1 += used;
    }

    /// Debits other replicas' use since the last sync (`requests`, `tokens`), today's budget
    /// included.
    pub(crate) fn absorb(&self, requests: u64, tokens: u64) {
        let limits = self.limits();
        let now = Instant::now();
        let mut meters = self.meters();
        #[allow(clippy::cast_precision_loss)]
        {
            if let Some(rpm) = limits.rpm {
                meters.requests.refill(rpm, now);
                meters.requests.level -= requests as f64;
            }
            if let Some(tpm) = limits.tpm {
                meters.tokens.refill(tpm, now);
                meters.tokens.level -= tokens as f64;
            }
        }
        meters.today += tokens;
    }

    /// This process's requests and tokens since the last call (for the replicas' sync).
    pub(crate) fn take_local(&self) -> (u64, u64) {
        std::mem::take(&mut *lock(&self.unsynced))
    }

    /// The current window: headers' values, tokens used today.
    pub(crate) fn window(&self) -> (RateHeaders, u64) {
        let limits = self.limits();
        let mut meters = self.meters();
        let headers = headers_of(&limits, &mut meters, Instant::now());
        (headers, meters.today)
    }

    fn set_limits(&self, limits: Limits) {
        let mut current = lock(&self.limits);
        if *current != limits {
            let now = Instant::now();
            let mut meters = self.meters();
            // A new allowance starts full only for a limit that was not there before.
            if current.rpm.is_none() {
                meters.requests = Bucket::full(limits.rpm, now);
            }
            if current.tpm.is_none() {
                meters.tokens = Bucket::full(limits.tpm, now);
            }
            *current = limits;
        }
    }
}

fn headers_of(limits: &Limits, meters: &mut Meters, now: Instant) -> RateHeaders {
    let values = |limit: Option<u64>, bucket: &mut Bucket| {
        limit.map(|limit| {
            let capacity = bucket.refill(limit, now);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let remaining = bucket.level.max(0.0).floor() as u64;
            (limit, remaining, bucket.wait_for(capacity, capacity))
        })
    };
    RateHeaders { requests: values(limits.rpm, &mut meters.requests), tokens: values(limits.tpm, &mut meters.tokens) }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A request's place in its tenant's limits: held until the request ends, then settled with
/// the tokens its answer reported (or an estimate), and its slot given back.
#[derive(Debug)]
pub(crate) struct TenantPass {
    tenant: Arc<Tenant>,
    estimate: u64,
    pub(crate) meter: UsageMeter,
    failed: bool,
    pub(crate) class: Class,
    pub(crate) headers: RateHeaders,
}

impl TenantPass {
    pub(crate) fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    /// The request failed (an error answer or a broken stream).
    pub(crate) fn fail(&mut self) {
        self.failed = true;
    }
}

impl Drop for TenantPass {
    fn drop(&mut self) {
        self.tenant.in_flight.fetch_sub(1, Ordering::AcqRel);
        let stats = &self.tenant.stats;
        if self.failed {
            stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        let (prompt, completion, estimated) = self.meter.tokens(self.estimate);
        stats.prompt_tokens.fetch_add(prompt, Ordering::Relaxed);
        stats.completion_tokens.fetch_add(completion, Ordering::Relaxed);
        if estimated {
            stats.estimated.fetch_add(1, Ordering::Relaxed);
        }
        self.tenant.settle(self.estimate, prompt + completion);
    }
}

/// Every tenant, by key and by name. Empty until the control plane loads a tenants file.
#[derive(Debug, Default)]
pub(crate) struct Tenants {
    by_key: ArcSwap<HashMap<Box<[u8]>, Arc<Tenant>>>,
    by_name: Mutex<HashMap<String, Arc<Tenant>>>,
    next_id: AtomicU32,
}

impl Tenants {
    /// Whether any tenant is configured (else no request pays for any of this).
    pub(crate) fn configured(&self) -> bool {
        !self.by_key.load().is_empty()
    }

    /// The tenant whose key is `key`.
    pub(crate) fn by_key(&self, key: &[u8]) -> Option<Arc<Tenant>> {
        self.by_key.load().get(key).cloned()
    }

    pub(crate) fn by_name(&self, name: &str) -> Option<Arc<Tenant>> {
        lock(&self.by_name).get(name).cloned()
    }

    /// Every configured tenant, by name.
    pub(crate) fn all(&self) -> Vec<Arc<Tenant>> {
        let mut all: Vec<_> = lock(&self.by_name).values().cloned().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    /// Replaces the tenants with `specs`: a tenant kept by name keeps its meters and counts;
    /// requests in flight finish under the limits they were admitted with.
    pub(crate) fn set(&self, specs: &[TenantSpec]) {
        let mut by_name = lock(&self.by_name);
        let mut kept = HashMap::with_capacity(specs.len());
        let mut by_key = HashMap::new();
        for spec in specs {
            let tenant = if let Some(tenant) = by_name.get(&spec.name) {
                tenant.set_limits(spec.limits);
                Arc::clone(tenant)
            } else {
                // Ids start at 1: 0 is the queue's "no tenant".
                let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
                Arc::new(Tenant::new(id, spec.name.clone(), spec.limits))
            };
            for key in &spec.keys {
                by_key.insert(key.as_bytes().into(), Arc::clone(&tenant));
            }
            kept.insert(spec.name.clone(), tenant);
        }
        *by_name = kept;
        self.by_key.store(Arc::new(by_key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(limits: Limits) -> (Tenants, Arc<Tenant>) {
        let tenants = Tenants::default();
        tenants.set(&[TenantSpec { name: "t".into(), keys: vec!["k".into()], limits }]);
        let tenant = tenants.by_key(b"k").unwrap();
        (tenants, tenant)
    }

    #[test]
    fn requests_per_minute() {
        let (_, tenant) = tenants(Limits { rpm: Some(2), ..Limits::default() });
        let a = tenant.admit(0, None).unwrap();
        assert_eq!(a.headers.requests.unwrap().0, 2);
        assert_eq!(a.headers.requests.unwrap().1, 1);
        let _b = tenant.admit(0, None).unwrap();
        let refused = tenant.admit(0, None).unwrap_err();
        assert_eq!(refused.limit, Limit::Requests);
        assert!(refused.retry_after >= 1 && refused.retry_after <= 30, "{}", refused.retry_after);
        assert_eq!(refused.headers.requests.unwrap().1, 0);
        assert_eq!(tenant.stats.rejected[Limit::Requests as usize].load(Ordering::Relaxed), 1);
    }

    #[test]
    fn concurrency_is_given_back_when_the_pass_ends() {
        let (_, tenant) = tenants(Limits { concurrency: Some(1), ..Limits::default() });
        let pass = tenant.admit(0, None).unwrap();
        assert_eq!(tenant.admit(0, None).unwrap_err().limit, Limit::Concurrency);
        drop(pass);
        assert_eq!(tenant.in_flight.load(Ordering::Relaxed), 0);
        assert!(tenant.admit(0, None).is_ok());
    }

    #[test]
    fn tokens_are_corrected_from_usage() {
        let (_, tenant) = tenants(Limits { tpm: Some(1000), ..Limits::default() });
        let mut pass = tenant.admit(100, None).unwrap();
        assert_eq!(pass.headers.tokens.unwrap().1, 900);
        pass.meter.observe(br#"{"usage":{"prompt_tokens":300,"completion_tokens":500,"total_tokens":800}}"#, 0);
        drop(pass);
        let (headers, today) = tenant.window();
        assert!(headers.tokens.unwrap().1 <= 201, "{:?}", headers.tokens);
        assert_eq!(today, 800);
        assert_eq!(tenant.stats.completion_tokens.load(Ordering::Relaxed), 500);
        let refused = tenant.admit(500, None).unwrap_err();
        assert_eq!(refused.limit, Limit::Tokens);
        assert!(refused.retry_after >= 17, "300 tokens at 1000/min: {}", refused.retry_after);
    }

    #[test]
    fn a_budget_runs_out() {
        let (_, tenant) = tenants(Limits { daily_tokens: Some(50), ..Limits::default() });
        let mut pass = tenant.admit(10, None).unwrap();
        pass.meter.observe(br#"{"usage":{"prompt_tokens":20,"completion_tokens":40}}"#, 0);
        drop(pass);
        let refused = tenant.admit(10, None).unwrap_err();
        assert_eq!(refused.limit, Limit::Budget);
        assert!(refused.retry_after <= 86_400);
    }

    #[test]
    fn priorities_are_bounded_by_the_key() {
        let (_, tenant) = tenants(Limits { priority: 5, priority_limit: 0, ..Limits::default() });
        assert_eq!(tenant.priority(None), 5);
        assert_eq!(tenant.priority(Some(-10)), 0);
        assert_eq!(tenant.priority(Some(9)), 9);
    }

    #[test]
    fn a_reload_keeps_meters_and_ids() {
        let (tenants, before) = tenants(Limits { rpm: Some(1), ..Limits::default() });
        let _pass = before.admit(0, None).unwrap();
        let limits = Limits { rpm: Some(1), concurrency: Some(4), ..Limits::default() };
        tenants.set(&[TenantSpec { name: "t".into(), keys: vec!["k2".into()], limits }]);
        assert!(tenants.by_key(b"k").is_none(), "the old key is gone");
        let after = tenants.by_key(b"k2").unwrap();
        assert_eq!(after.id, before.id);
        assert_eq!(after.admit(0, None).unwrap_err().limit, Limit::Requests, "the minute's use is kept");
    }

    #[test]
    fn resets_read_as_openai_writes_them() {
        assert_eq!(duration_text(0.02), "20ms");
        assert_eq!(duration_text(0.0), "0ms");
        assert_eq!(duration_text(1.5), "1.5s");
        assert_eq!(duration_text(360.0), "6m0s");
        assert_eq!(duration_text(61.25), "1m1.25s");
        assert_eq!(duration_text(2.005), "2.005s");
        assert_eq!(duration_text(2.05), "2.05s");
    }

    #[test]
    fn headers_name_each_window() {
        let headers = RateHeaders { requests: Some((3, 2, 20.0)), tokens: None };
        let got: Vec<_> = headers.to_headers().map(|(n, v)| format!("{n}: {}", v.to_str().unwrap())).collect();
        assert_eq!(
            got,
            ["x-ratelimit-limit-requests: 3", "x-ratelimit-remaining-requests: 2", "x-ratelimit-reset-requests: 20s"]
        );
    }

    #[test]
    fn other_replicas_use_is_debited() {
        let (_, tenant) = tenants(Limits { rpm: Some(10), ..Limits::default() });
        tenant.absorb(10, 0);
        assert_eq!(tenant.admit(0, None).unwrap_err().limit, Limit::Requests);
    }
}
