//! The W3C trace context: the `traceparent` a request comes with and passes on, trace and span
//! ids, and the sampler that decides which traces are recorded.

/// A span's id (W3C: 8 bytes, not all zero).
pub(crate) type SpanId = [u8; 8];

pub(crate) static TRACEPARENT: http::header::HeaderName = http::header::HeaderName::from_static("traceparent");

/// Which traces are recorded (OpenTelemetry's samplers, by their `OTEL_TRACES_SAMPLER` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// This share of traces, decided from the trace id (so every hop decides alike).
    Ratio(f64),
    /// As the caller decided when there is one; else the inner sampler.
    ParentBased(Base),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Base {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

impl Sampler {
    /// From `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`.
    pub(crate) fn parse(name: &str, arg: Option<f64>) -> Option<Self> {
        let ratio = arg.unwrap_or(1.0).clamp(0.0, 1.0);
        Some(match name {
            "always_on" => Sampler::AlwaysOn,
            "always_off" => Sampler::AlwaysOff,
            "traceidratio" => Sampler::Ratio(ratio),
            "parentbased_always_on" => Sampler::ParentBased(Base::AlwaysOn),
            "parentbased_always_off" => Sampler::ParentBased(Base::AlwaysOff),
            "parentbased_traceidratio" => Sampler::ParentBased(Base::Ratio(ratio)),
            _ => return None,
        })
    }

    pub(super) fn sampled(self, trace: &[u8; 16], parent: Option<bool>) -> bool {
        let ratio = |r: f64| {
            // The trace id's last 8 bytes as a fraction of 2^64, as OpenTelemetry does.
            let tail = u64::from_be_bytes(trace[8..].try_into().unwrap_or_default());
            #[allow(clippy::cast_precision_loss)]
            let share = tail as f64 / u64::MAX as f64;
            share < r
        };
        match self {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::Ratio(r) => ratio(r),
            Sampler::ParentBased(base) => parent.unwrap_or(match base {
                Base::AlwaysOn => true,
                Base::AlwaysOff => false,
                Base::Ratio(r) => ratio(r),
            }),
        }
    }
}

/// `00-<trace id>-<span id>-<flags>`: the trace, the caller's span and whether it sampled.
pub(crate) fn parse_traceparent(raw: &[u8]) -> Option<([u8; 16], SpanId, bool)> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    let mut parts = text.split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    let trace: [u8; 16] = unhex(trace)?;
    let span: [u8; 8] = unhex(span)?;
    let flags: [u8; 1] = unhex(flags)?;
    if trace == [0; 16] || span == [0; 8] {
        return None;
    }
    Some((trace, span, flags[0] & 1 == 1))
}

/// The trace id of a `traceparent`, as logs show it.
pub(crate) fn trace_id_of(raw: &[u8]) -> Option<String> {
    parse_traceparent(raw).map(|(trace, _, _)| hex(&trace))
}

pub(super) fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

pub(super) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

pub(super) fn push_hex(out: &mut String, bytes: &[u8]) {
    for &b in bytes {
        let [high, low] = hex_pair(b);
        out.push(char::from(high));
        out.push(char::from(low));
    }
}

pub(super) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    loop {
        for b in &mut out {
            *b = fastrand::u8(..);
        }
        if out.iter().any(|&b| b != 0) {
            return out;
        }
    }
}

pub(super) fn hex_pair(b: u8) -> [u8; 2] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 0xf)]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_parsed_strictly() {
        let (trace, span, sampled) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(hex(&trace), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex(&span), "00f067aa0ba902b7");
        assert!(sampled);
        for bad in [
            &b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            b"garbage",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn samplers() {
        let id = [0xffu8; 16];
        assert!(!Sampler::Ratio(0.5).sampled(&id, None), "the highest ids fall outside a half");
        assert!(Sampler::Ratio(1.0).sampled(&[0; 16], None));
        assert!(!Sampler::ParentBased(Base::AlwaysOn).sampled(&id, Some(false)), "the caller said no");
        assert!(Sampler::ParentBased(Base::AlwaysOff).sampled(&id, Some(true)));
        assert_eq!(Sampler::parse("parentbased_traceidratio", Some(0.1)), Some(Sampler::ParentBased(Base::Ratio(0.1))));
        assert_eq!(Sampler::parse("nope", None), None);
    }
}
