//! A million generated requests through the forwarding-header parsers and the key
//! extractors: valid, malformed, huge and not ASCII. None may panic, and each key must
//! be the client the trusted proxies named, the peer, or none — never an address a
//! client wrote for itself.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::http::{HeaderName, HeaderValue, Request};
use support::Rng;
use tollway_tower::{ApiKey, ClientIp, Fallback, ForwardedHeader, Key, KeyExtractor};

/// How many requests are generated.
const INPUTS: u64 = 1_000_000;
/// The proxies in front of the service.
const TRUSTED: [&str; 2] = ["10.0.0.0/8", "2001:db8:ffff::/48"];
/// The API keys the service issued.
const ISSUED: [&str; 2] = ["issued-1", "issued-2"];
/// The most forwarding entries the extractor reads.
const MAX_HOPS: usize = 32;

const HEADERS: [ForwardedHeader; 3] = [
    ForwardedHeader::Forwarded,
    ForwardedHeader::XForwardedFor,
    ForwardedHeader::XRealIp,
];

fn name(header: ForwardedHeader) -> &'static str {
    match header {
        ForwardedHeader::Forwarded => "forwarded",
        ForwardedHeader::XForwardedFor => "x-forwarded-for",
        _ => "x-real-ip",
    }
}

/// What the extractor must answer for one input.
#[derive(Debug)]
enum Expected {
    /// Exactly this client (or no key).
    Exactly(Option<IpAddr>),
    /// For bytes generated at random: no key, the peer, or an address written somewhere
    /// in the configured header.
    OneOf(Vec<IpAddr>),
}

/// One generated request and what its key must be.
struct Case {
    header: ForwardedHeader,
    request: Request<()>,
    expected: Expected,
    api_key: Option<Vec<u8>>,
}

#[test]
fn a_million_generated_forwarding_headers_never_panic_or_name_a_forged_client() {
    let extractors = HEADERS.map(|h| ClientIp::new(h, TRUSTED).unwrap());
    let issued: HashSet<String> = ISSUED.iter().map(|k| (*k).to_owned()).collect();
    let chains = extractors.clone().map(|client_ip| {
        ApiKey::header("x-api-key")
            .unwrap()
            .known(issued.clone())
            .or(client_ip)
    });
    let mut rng = Rng(0x7011_7a11);
    let (mut named, mut peers, mut unknown) = (0u64, 0u64, 0u64);
    for i in 0..INPUTS {
        let case = generate(&mut rng, i);
        let which = HEADERS.iter().position(|h| *h == case.header).unwrap();
        let key = extractors[which].extract(&case.request);
        let peer = peer_of(&case.request);
        match &case.expected {
            Expected::Exactly(client) => {
                assert_eq!(
                    key,
                    client.map(|ip| Key::ip(ip, 64)),
                    "input {i}: {:?}",
                    case.request
                );
            }
            Expected::OneOf(allowed) => {
                let fits = key.is_none() || allowed.iter().any(|ip| key == Some(Key::ip(*ip, 64)));
                assert!(fits, "input {i}: {key:?} from {:?}", case.request);
            }
        }
        match &key {
            None => unknown += 1,
            Some(k) if *k == Key::ip(peer, 64) => peers += 1,
            Some(_) => named += 1,
        }
        // The chain: an issued API key, else the same client.
        let chained = chains[which].extract(&case.request);
        let issued_key = case
            .api_key
            .as_ref()
            .filter(|v| ISSUED.iter().any(|k| k.as_bytes() == v.as_slice()));
        match issued_key {
            Some(value) => assert_eq!(chained, Some(Key::new("key", value)), "input {i}"),
            None => assert_eq!(chained, key, "input {i}"),
        }
    }
    println!(
        "{INPUTS} inputs: {named} clients named by the proxies, {peers} peers, {unknown} unknown"
    );
    // The generator reaches every kind of answer.
    assert!(named > INPUTS / 4 && peers > INPUTS / 10 && unknown > INPUTS / 20);
}

fn peer_of(request: &Request<()>) -> IpAddr {
    request.extensions().get::<SocketAddr>().unwrap().ip()
}

fn generate(rng: &mut Rng, i: u64) -> Case {
    let header = HEADERS[rng.below(3) as usize];
    let peer_is_proxy = rng.below(4) != 0;
    let peer = if peer_is_proxy {
        proxy(rng)
    } else {
        outsider(rng)
    };
    let peer = if rng.below(8) == 0 {
        // Some servers report IPv4 peers in IPv4-mapped form.
        match peer {
            IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
            v6 => v6,
        }
    } else {
        peer
    };
    let mut lines: Vec<(&str, Vec<u8>)> = Vec::new();
    let expected = if i % 10 == 9 {
        // Random bytes in every header.
        for h in HEADERS {
            for _ in 0..rng.below(3) {
                lines.push((name(h), random_bytes(rng)));
            }
        }
        let mut allowed = vec![peer];
        for (n, value) in &lines {
            if *n == name(header) {
                allowed.extend(addresses_in(value));
            }
        }
        Expected::OneOf(allowed)
    } else {
        // What a chain of proxies writes, with the client's forgeries.
        let (own, expected) = chain(rng, header);
        // The other headers: whatever the client sent, never read.
        for h in HEADERS {
            if h != header && rng.below(2) == 0 {
                lines.push((name(h), forgery(rng, h)));
            }
        }
        lines.extend(own.into_iter().map(|v| (name(header), v)));
        Expected::Exactly(if peer_is_proxy {
            expected.unwrap_or(Some(peer))
        } else {
            Some(peer)
        })
    };
    let expected = match expected {
        // An untrusted peer is the client, whatever the headers say.
        Expected::OneOf(_) if !peer_is_proxy => Expected::Exactly(Some(peer)),
        e => e,
    };
    let api_key = match rng.below(5) {
        0 => None,
        1 => Some(ISSUED[rng.below(2) as usize].as_bytes().to_vec()),
        2 => Some(format!("made-up-{}", rng.next_u64()).into_bytes()),
        3 => Some(random_bytes(rng)),
        _ => Some(vec![b'k'; 1 + rng.below(20_000) as usize]),
    };
    let mut request = Request::get("/");
    for (n, value) in lines
        .iter()
        .map(|(n, v)| (*n, v.as_slice()))
        .chain(api_key.as_deref().map(|v| ("x-api-key", v)))
    {
        request = request.header(
            HeaderName::from_static(n),
            HeaderValue::from_bytes(value).unwrap(),
        );
    }
    let mut request = request.body(()).unwrap();
    request
        .extensions_mut()
        .insert(SocketAddr::new(peer, 1 + rng.below(65_535) as u16));
    Case {
        header,
        request,
        expected,
        api_key,
    }
}

/// The configured header's lines as the proxies leave them, and its client: `None` when
/// the header is absent (the peer is the client), `Some(None)` when the proxies could
/// not name one.
fn chain(rng: &mut Rng, header: ForwardedHeader) -> (Vec<Vec<u8>>, Option<Option<IpAddr>>) {
    if rng.below(20) == 0 {
        return (Vec::new(), None);
    }
    if header == ForwardedHeader::XRealIp {
        // The one proxy in front sets it; a client's own copies come first.
        let mut lines: Vec<Vec<u8>> = (0..rng.below(2)).map(|_| forgery(rng, header)).collect();
        let (entry, client) = client_entry(rng, header);
        lines.push(entry);
        return (lines, Some(client));
    }
    // Left to right: what the client wrote, its entry by the first proxy, one entry per
    // further trusted proxy.
    let mut entries: Vec<Vec<u8>> = Vec::new();
    match rng.below(5_000) {
        0 => entries.extend((0..10_000).map(|_| {
            let ip = outsider(rng);
            written(rng, header, ip)
        })),
        _ => entries.extend((0..rng.below(4)).map(|_| forgery(rng, header))),
    }
    let (entry, client) = client_entry(rng, header);
    entries.push(entry);
    let hops = if rng.below(200) == 0 {
        MAX_HOPS - 2 + rng.below(8) as usize
    } else {
        rng.below(4) as usize
    };
    entries.extend((0..hops).map(|_| {
        let ip = proxy(rng);
        written(rng, header, ip)
    }));
    // Past the last 32 entries nothing is read: all of those were proxies.
    let client = if hops >= MAX_HOPS { None } else { client };
    // The entries on one line or several, as proxies append them.
    let mut lines = vec![Vec::new()];
    for (i, entry) in entries.into_iter().enumerate() {
        if i > 0 {
            if rng.below(4) == 0 && !lines.last().unwrap().is_empty() {
                lines.push(Vec::new());
            } else {
                let separator: &[u8] = if rng.below(2) == 0 { b", " } else { b"," };
                lines.last_mut().unwrap().extend_from_slice(separator);
            }
        }
        lines.last_mut().unwrap().extend_from_slice(&entry);
    }
    (lines, Some(client))
}

/// The entry the first proxy wrote for the client, and its address when it has one.
fn client_entry(rng: &mut Rng, header: ForwardedHeader) -> (Vec<u8>, Option<IpAddr>) {
    if rng.below(6) == 0 {
        let junk: &[&[u8]] = &[
            b"unknown",
            b"_hidden",
            b"for=unknown",
            b"for=_a1b2",
            b"proto=https",
            b"",
            b"999.1.2.3",
            b"1.2.3.4:99999",
            b"[2001:db8::1",
            b"caf\xe9",
            b"\xff\xfe\xfd",
            b"123456789012345678901234567890123456789012345678901234567890123456789",
        ];
        return (junk[rng.below(junk.len() as u64) as usize].to_vec(), None);
    }
    let client = outsider(rng);
    (written(rng, header, client), Some(client))
}

/// `ip` as a proxy writes it in `header`, in one of the forms proxies use.
fn written(rng: &mut Rng, header: ForwardedHeader, ip: IpAddr) -> Vec<u8> {
    let port = 1 + rng.below(65_535);
    let text = match (header, ip, rng.below(4)) {
        // RFC 7239: IPv6 and anything with a port quoted, IPv6 in brackets.
        (ForwardedHeader::Forwarded, ip, form) => {
            let value = match (ip, form) {
                (IpAddr::V4(v4), 0) => v4.to_string(),
                (IpAddr::V4(v4), 1) => format!("\"{v4}:{port}\""),
                (IpAddr::V4(v4), 2) => format!("\"{v4}\""),
                (IpAddr::V4(v4), _) => format!("\"[{}]\"", v4.to_ipv6_mapped()),
                (IpAddr::V6(v6), 0 | 1) => format!("\"[{v6}]\""),
                (IpAddr::V6(v6), _) => format!("\"[{v6}]:{port}\""),
            };
            match rng.below(3) {
                0 => format!("for={value}"),
                1 => format!("For={value};proto=https"),
                _ => format!("proto=http;for={value};by=_gateway"),
            }
        }
        (_, IpAddr::V4(v4), 0) => format!("{v4}:{port}"),
        (_, IpAddr::V4(v4), 1) => v4.to_ipv6_mapped().to_string(),
        (_, IpAddr::V6(v6), 0) => format!("[{v6}]:{port}"),
        (_, IpAddr::V6(v6), 1) => format!("[{v6}]"),
        (_, ip, _) => ip.to_string(),
    };
    text.into_bytes()
}

/// What a client might write in a header to pass for someone else.
fn forgery(rng: &mut Rng, header: ForwardedHeader) -> Vec<u8> {
    match rng.below(4) {
        0 => {
            let ip = proxy(rng);
            written(rng, header, ip)
        }
        1 => {
            let ip = outsider(rng);
            written(rng, header, ip)
        }
        2 => b"unknown".to_vec(),
        _ => random_bytes(rng),
    }
}

/// A trusted proxy's address.
fn proxy(rng: &mut Rng) -> IpAddr {
    if rng.below(3) == 0 {
        IpAddr::V6(Ipv6Addr::new(
            0x2001,
            0xdb8,
            0xffff,
            0,
            0,
            0,
            0,
            rng.below(1 << 16) as u16,
        ))
    } else {
        let [_, b, c, d] = (rng.next_u64() as u32).to_be_bytes();
        IpAddr::V4(Ipv4Addr::new(10, b, c, d))
    }
}

/// An address outside the trusted networks.
fn outsider(rng: &mut Rng) -> IpAddr {
    if rng.below(3) == 0 {
        let group = rng.below(1 << 16) as u16;
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 1, group, 0, 0, 0, 7))
    } else {
        let [a, b, c, d] = (rng.next_u64() as u32).to_be_bytes();
        let a = if a == 10 || a == 0 { 198 } else { a };
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }
}

/// Bytes a header value may hold, biased to the ones addresses are written with; now
/// and then long.
fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    const COMMON: &[u8] = b"0123456789abcdef.:,;=\"[]_ forFOR\t";
    let len = match rng.below(100) {
        0 => rng.below(5_000),
        _ => rng.below(60),
    };
    let mut bytes: Vec<u8> = (0..len)
        .map(|_| match rng.below(10) {
            0 => 0x80 + rng.below(0x80) as u8,
            1 => 0x20 + rng.below(0x5f) as u8,
            _ => COMMON[rng.below(COMMON.len() as u64) as usize],
        })
        .collect();
    // A header value neither starts nor ends with whitespace once sent.
    while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
        bytes.pop();
    }
    if bytes.is_empty() {
        bytes.push(b'x');
    }
    bytes
}

/// Every address written in `value`: each run of address characters that parses, with
/// or without a port.
fn addresses_in(value: &[u8]) -> Vec<IpAddr> {
    value
        .split(|b| !(b.is_ascii_hexdigit() || *b == b'.' || *b == b':'))
        .filter_map(|run| std::str::from_utf8(run).ok())
        .flat_map(|run| {
            let whole = run.parse::<IpAddr>().ok();
            let with_port = run.parse::<SocketAddr>().ok().map(|s| s.ip());
            // `1.2.3.4:80` inside `[...]`, or a v6 followed by `:port`.
            let before_port = run
                .rsplit_once(':')
                .and_then(|(ip, _)| ip.parse::<IpAddr>().ok());
            [whole, with_port, before_port]
        })
        .flatten()
        .collect()
}
