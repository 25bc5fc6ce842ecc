//! Which addresses a node may have: a node URL is where the proxy will send requests, so an
//! attacker who can register nodes must not be able to point it at internal services. The
//! host and port come from the node's URL as `NodeUrl` parsed it, once; the name is resolved
//! here and the first address pinned, so that it is not resolved again at connect time.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::error::{Error, Kind, Result};

use super::NodeUrl;

/// Cloud metadata and platform services, reachable from most VMs: AWS/GCP/Azure/OpenStack
/// (169.254.169.254), ECS (169.254.170.2), AWS over IPv6, Alibaba (100.100.100.200), Azure's
/// wire server (168.63.129.16), Oracle Cloud (192.0.0.192).
const METADATA: [IpAddr; 6] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 2)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
];

/// IPv6 networks Python's `ipaddress` calls reserved (`IPv6Address.is_reserved`), so that both
/// planes refuse the same addresses.
const RESERVED_V6: [(u16, u8); 15] = [
    (0x0000, 8),
    (0x0100, 8),
    (0x0200, 7),
    (0x0400, 6),
    (0x0800, 5),
    (0x1000, 4),
    (0x4000, 3),
    (0x6000, 3),
    (0x8000, 3),
    (0xa000, 3),
    (0xc000, 3),
    (0xe000, 4),
    (0xf000, 5),
    (0xf800, 6),
    (0xfe00, 9),
];

/// A network (`10.0.0.0/8`): its address and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Network {
    address: IpAddr,
    prefix: u8,
}

impl Network {
    /// Reads `ADDRESS/PREFIX` (or a bare address); host bits may be set, as Python's
    /// `ip_network(..., strict=False)` allows.
    pub(crate) fn parse(text: &str) -> Result<Self> {
        let refused = || Error::new(Kind::Config, format!("{text:?} is not a network"));
        let (address, prefix) = text.trim().split_once('/').unwrap_or((text.trim(), ""));
        let address: IpAddr = address.parse().map_err(|_| refused())?;
        let top = if address.is_ipv4() { 32 } else { 128 };
        let prefix = if prefix.is_empty() { top } else { prefix.parse().map_err(|_| refused())? };
        if prefix > top {
            return Err(refused());
        }
        Ok(Self { address, prefix })
    }

    fn contains(self, address: IpAddr) -> bool {
        match (self.address, address) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                same_prefix(u32::from(net).into(), u32::from(a).into(), 32, self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => same_prefix(u128::from(net), u128::from(a), 128, self.prefix),
            _ => false,
        }
    }
}

fn same_prefix(net: u128, address: u128, width: u8, prefix: u8) -> bool {
    prefix == 0 || (net ^ address) >> (width - prefix) == 0
}

fn in_v6(address: Ipv6Addr, top: u16, prefix: u8) -> bool {
    same_prefix(u128::from(top) << 112, u128::from(address), 128, prefix)
}

/// The IPv4 address an IPv6 address stands for (mapped, 6to4, Teredo, NAT64), if any.
pub(crate) fn embedded_ipv4(address: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = address else { return None };
    let bits = u128::from(v6);
    if let Some(mapped) = v6.to_ipv4_mapped() {
        return Some(mapped);
    }
    let low32 = |value: u128| Ipv4Addr::from(u32::try_from(value & 0xFFFF_FFFF).unwrap_or(0));
    if in_v6(v6, 0x2002, 16) {
        return Some(low32(bits >> 80)); // 6to4
    }
    if v6.segments()[..2] == [0x2001, 0] {
        return Some(low32(!bits)); // Teredo: the client, bits inverted
    }
    if v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(low32(bits)); // NAT64
    }
    None
}

/// Why `address` may not be a node's, if it may not.
fn refusal(address: IpAddr, allowed: &[Network]) -> Option<String> {
    if let Some(inner) = embedded_ipv4(address) {
        return refusal(IpAddr::V4(inner), allowed).map(|reason| format!("{reason} (as {inner})"));
    }
    let (link_local, multicast, reserved) = match address {
        IpAddr::V4(a) => (a.is_link_local(), a.is_multicast(), a.octets()[0] >= 240),
        IpAddr::V6(a) => {
            (in_v6(a, 0xfe80, 10), a.is_multicast(), RESERVED_V6.iter().any(|&(top, prefix)| in_v6(a, top, prefix)))
        }
    };
    if address.is_unspecified() {
        Some("the unspecified address (this host)".to_owned())
    } else if METADATA.contains(&address) {
        Some("a cloud metadata address".to_owned())
    } else if link_local {
        Some("a link-local address".to_owned())
    } else if multicast || reserved {
        Some("not a unicast address".to_owned())
    } else if !allowed.is_empty() && !allowed.iter().any(|n| n.contains(address)) {
        Some("outside the allowed networks".to_owned())
    } else {
        None
    }
}

/// Whether `address` is one of this machine's own (a socket can be bound to it).
fn is_local(address: IpAddr) -> bool {
    address.is_loopback() || address.is_unspecified() || TcpListener::bind(SocketAddr::new(address, 0)).is_ok()
}

/// The rules a node's addresses must pass: the allowed networks (none: any network) and this
/// proxy's own port (a node on a local address at that port would be the proxy itself).
#[derive(Debug, Clone, Default)]
pub(crate) struct AddressRules {
    pub(crate) allowed: Vec<Network>,
    pub(crate) own_port: Option<u16>,
}

impl AddressRules {
    /// The address the node at `url` is to be reached at, once its host resolves only to
    /// permitted addresses. Blocks while the name resolves.
    pub(crate) fn resolve(&self, url: &NodeUrl) -> Result<SocketAddr> {
        let (host, port) = host_and_port(url)?;
        let addresses: Vec<IpAddr> = match (host, port).to_socket_addrs() {
            Ok(found) => found.map(|a| a.ip()).collect(),
            Err(e) => {
                let why = e.to_string();
                let why = why.strip_prefix("failed to lookup address information: ").unwrap_or(&why).to_owned();
                return Err(unresolvable(url, Some(&why)));
            }
        };
        self.check(url, host, port, &addresses)?;
        Ok(SocketAddr::new(addresses[0], port))
    }

    /// `resolve` without resolving: refuses a node whose host is an address the rules refuse
    /// (a name is checked when the node is added, once it resolves).
    pub(crate) fn check_literal(&self, url: &NodeUrl) -> Result<()> {
        let (host, port) = host_and_port(url)?;
        match host.split('%').next().unwrap_or(host).parse::<IpAddr>() {
            Ok(address) => self.check(url, host, port, &[address]),
            Err(_) => Ok(()),
        }
    }

    fn check(&self, url: &NodeUrl, host: &str, port: u16, addresses: &[IpAddr]) -> Result<()> {
        let url = &url.normalized;
        if addresses.is_empty() {
            return Err(Error::new(Kind::NodeUnresolvable, format!("node {url}: its host does not resolve")));
        }
        for &address in addresses {
            if let Some(reason) = refusal(address, &self.allowed) {
                return Err(Error::new(
                    Kind::InvalidNode,
                    format!("node {url}: {host} resolves to {address}, {reason}"),
                ));
            }
            if self.own_port == Some(port) && is_local(address) {
                return Err(Error::new(Kind::InvalidNode, format!("node {url}: that is this proxy itself")));
            }
        }
        Ok(())
    }
}

fn unresolvable(url: &NodeUrl, why: Option<&str>) -> Error {
    let url = &url.normalized;
    match why {
        Some(why) => Error::new(Kind::NodeUnresolvable, format!("node {url}: its host does not resolve ({why})")),
        None => Error::new(Kind::NodeUnresolvable, format!("node {url}: its host does not resolve")),
    }
}

/// The URL's host (an IPv6 address without its brackets) and port (the scheme's by default).
fn host_and_port(url: &NodeUrl) -> Result<(&str, u16)> {
    let host = url.authority.host();
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let invalid = |what: &str| Error::new(Kind::InvalidNode, format!("node {}: {what}", url.normalized));
    if host.is_empty() {
        return Err(invalid("the URL has no host"));
    }
    if host.len() > 253 || host.split('.').any(|label| label.len() > 63) {
        return Err(invalid("the host is not a valid name (labels of at most 63 characters)"));
    }
    let port = match url.authority.port() {
        None => url.default_port(),
        Some(port) => port.as_u16(),
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(address: &str, allowed: &[&str]) -> Option<String> {
        let allowed: Vec<Network> = allowed.iter().map(|n| Network::parse(n).unwrap()).collect();
        refusal(address.parse().unwrap(), &allowed)
    }

    #[test]
    fn refuses_what_python_refused() {
        for (address, reason) in [
            ("0.0.0.0", "the unspecified address (this host)"),
            ("::", "the unspecified address (this host)"),
            ("169.254.169.254", "a cloud metadata address"),
            ("fd00:ec2::254", "a cloud metadata address"),
            ("168.63.129.16", "a cloud metadata address"),
            ("169.254.1.1", "a link-local address"),
            ("fe80::1", "a link-local address"),
            ("224.0.0.1", "not a unicast address"),
            ("255.255.255.255", "not a unicast address"),
            ("ff02::1", "not a unicast address"),
            ("::1", "not a unicast address"),
            ("2002:a9fe:a9fe::1", "a cloud metadata address (as 169.254.169.254)"),
            ("2001:0:4136:e378:8000:63bf:5601:5601", "a cloud metadata address (as 169.254.169.254)"),
            ("::ffff:169.254.169.254", "a cloud metadata address (as 169.254.169.254)"),
            ("64:ff9b::a9fe:a9fe", "a cloud metadata address (as 169.254.169.254)"),
        ] {
            assert_eq!(refused(address, &[]).as_deref(), Some(reason), "{address}");
        }
        for address in ["127.0.0.1", "10.1.2.3", "2606:4700::1111", "::ffff:10.0.0.1"] {
            assert_eq!(refused(address, &[]), None, "{address}");
        }
    }

    #[test]
    fn allowed_networks_bound_the_rest() {
        assert_eq!(refused("10.1.2.3", &["10.0.0.0/8"]), None);
        assert_eq!(refused("10.1.2.3", &["10.9.0.0/16"]).as_deref(), Some("outside the allowed networks"));
        assert_eq!(refused("10.1.2.3", &["10.1.2.3"]), None, "a bare address is a /32");
        assert_eq!(refused("2606:4700::1", &["2606:4700::/32"]), None);
        assert_eq!(refused("10.1.2.3", &["::/0"]).as_deref(), Some("outside the allowed networks"));
        assert_eq!(refused("10.1.2.3", &["0.0.0.0/0"]), None);
        assert!(Network::parse("10.0.0.0/33").is_err());
    }

    #[test]
    fn checks_hosts_and_the_proxy_itself() {
        let rules = AddressRules { allowed: vec![], own_port: Some(8000) };
        let url = |raw: &str| NodeUrl::parse(raw).unwrap();
        assert_eq!(rules.resolve(&url("http://127.0.0.1:8001")).unwrap().to_string(), "127.0.0.1:8001");
        assert_eq!(rules.resolve(&url("http://127.0.0.1")).unwrap().port(), 80);
        assert_eq!(rules.resolve(&url("https://127.0.0.1")).unwrap().port(), 443);
        let itself = rules.resolve(&url("http://127.0.0.1:8000")).unwrap_err();
        assert_eq!(itself.message(), "node http://127.0.0.1:8000: that is this proxy itself");
        let zero = rules.resolve(&url("http://0:8001")).unwrap_err();
        assert_eq!(zero.kind(), Kind::InvalidNode, "{zero:?}");
        let long = format!("http://{}.example", "a".repeat(64));
        assert_eq!(rules.resolve(&url(&long)).unwrap_err().kind(), Kind::InvalidNode);
        assert_eq!(rules.resolve(&url("http://no-such-host.invalid")).unwrap_err().kind(), Kind::NodeUnresolvable);
        assert!(rules.check_literal(&url("http://some-name:8001")).is_ok(), "names wait for resolution");
        assert!(rules.check_literal(&url("http://[fe80::1]:80")).is_err());
    }
}
