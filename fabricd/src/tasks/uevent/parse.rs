//! The kernel uevent message format, parsed from untrusted bytes: a header
//! `ACTION@DEVPATH`, then `KEY=VALUE` fields, each ended by a NUL byte (what
//! `lib/kobject_uevent.c` broadcasts on `NETLINK_KOBJECT_UEVENT` group 1). Bounded: at
//! most [`MAX_MESSAGE`] bytes and [`MAX_FIELDS`] fields; every defect is a typed
//! [`ParseError`], never a panic.

/// Largest message accepted, bytes (the kernel's own buffer is 2 KiB of fields plus the
/// header).
pub const MAX_MESSAGE: usize = 8192;
/// Most `KEY=VALUE` fields accepted (the kernel sends at most 64).
pub const MAX_FIELDS: usize = 128;
/// Longest text quoted back in an error.
const QUOTE: usize = 64;

/// Why a message is not a kernel uevent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Nothing was received.
    #[error("empty message")]
    Empty,
    /// The message is longer than [`MAX_MESSAGE`].
    #[error("message of {0} bytes is over the {MAX_MESSAGE}-byte limit")]
    TooLong(usize),
    /// A udev (`libudev`) message, which only udev's group carries.
    #[error("a libudev message, not a kernel uevent")]
    Udev,
    /// The first field is not `ACTION@DEVPATH`.
    #[error("header {0:?} is not ACTION@/DEVPATH")]
    BadHeader(String),
    /// A field is not UTF-8.
    #[error("field {0} is not UTF-8")]
    NotUtf8(usize),
    /// A field is not `KEY=VALUE` with a key of letters, digits and `_`.
    #[error("field {index} {text:?} is not KEY=VALUE")]
    BadField {
        /// Its position (the header is 0).
        index: usize,
        /// Its start.
        text: String,
    },
    /// More than [`MAX_FIELDS`] fields.
    #[error("more than {MAX_FIELDS} fields")]
    TooManyFields,
    /// `ACTION` or `DEVPATH` disagrees with the header.
    #[error("{key}={field:?} disagrees with the header's {header:?}")]
    Mismatch {
        /// `ACTION` or `DEVPATH`.
        key: &'static str,
        /// The field's value.
        field: String,
        /// The header's value.
        header: String,
    },
    /// `SEQNUM` is not a decimal number.
    #[error("SEQNUM {0:?} is not a number")]
    BadSeqnum(String),
}

fn quote(s: &str) -> String {
    s.chars().take(QUOTE).collect()
}

/// One kernel uevent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uevent {
    /// `add`, `remove`, `change`, `move`, `online`, `offline`, `bind`, `unbind`, ...
    pub action: String,
    /// The kobject path under `/sys` (`/devices/pci0000:00/0000:00:01.0`).
    pub devpath: String,
    /// `SUBSYSTEM` (`pci`, `cxl`, `net`, ...), when sent.
    pub subsystem: Option<String>,
    /// `SEQNUM`, when sent.
    pub seqnum: Option<u64>,
    /// Every field in order (`ACTION`, `DEVPATH`, `SUBSYSTEM` and `SEQNUM` included).
    pub fields: Vec<(String, String)>,
}

impl Uevent {
    /// The value of field `key`, if sent.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

fn is_key(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Parses one message as received from the socket.
pub fn parse(buf: &[u8]) -> Result<Uevent, ParseError> {
    if buf.is_empty() {
        return Err(ParseError::Empty);
    }
    if buf.len() > MAX_MESSAGE {
        return Err(ParseError::TooLong(buf.len()));
    }
    if buf.starts_with(b"libudev\0") {
        return Err(ParseError::Udev);
    }
    // Each piece ends with a NUL; a last piece without one is accepted as well.
    let body = buf.strip_suffix(b"\0").unwrap_or(buf);
    let mut pieces = body.split(|b| *b == 0);
    let head = pieces.next().unwrap_or_default();
    let head = std::str::from_utf8(head).map_err(|_| ParseError::NotUtf8(0))?;
    let bad_header = || ParseError::BadHeader(quote(head));
    let (action, devpath) = head.split_once('@').ok_or_else(bad_header)?;
    if action.is_empty() || !action.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') || !devpath.starts_with('/') {
        return Err(bad_header());
    }
    let mut fields = Vec::new();
    for (i, piece) in pieces.enumerate() {
        let index = i + 1;
        if fields.len() == MAX_FIELDS {
            return Err(ParseError::TooManyFields);
        }
        let text = std::str::from_utf8(piece).map_err(|_| ParseError::NotUtf8(index))?;
        let (k, v) = text.split_once('=').ok_or_else(|| ParseError::BadField { index, text: quote(text) })?;
        if !is_key(k) {
            return Err(ParseError::BadField { index, text: quote(text) });
        }
        fields.push((k.to_owned(), v.to_owned()));
    }
    let ev = Uevent { action: action.to_owned(), devpath: devpath.to_owned(), subsystem: None, seqnum: None, fields };
    for (key, header) in [("ACTION", action), ("DEVPATH", devpath)] {
        if let Some(field) = ev.get(key)
            && field != header
        {
            return Err(ParseError::Mismatch { key, field: quote(field), header: quote(header) });
        }
    }
    let subsystem = ev.get("SUBSYSTEM").map(str::to_owned);
    let seqnum = match ev.get("SEQNUM") {
        Some(s) => Some(s.parse::<u64>().map_err(|_| ParseError::BadSeqnum(quote(s)))?),
        None => None,
    };
    Ok(Uevent { subsystem, seqnum, ..ev })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from a real kernel (`echo change > /sys/class/net/lo/uevent` and
    // `.../node/node0/uevent`).
    const LO: &[u8] = b"change@/devices/virtual/net/lo\0ACTION=change\0DEVPATH=/devices/virtual/net/lo\0SUBSYSTEM=net\0SYNTH_UUID=0\0INTERFACE=lo\0IFINDEX=1\0SEQNUM=820\0";
    const NODE: &[u8] = b"change@/devices/system/node/node0\0ACTION=change\0DEVPATH=/devices/system/node/node0\0SUBSYSTEM=node\0SYNTH_UUID=0\0SEQNUM=821\0";
    // A PCI hot-add as the kernel sends it.
    const PCI_ADD: &[u8] = b"add@/devices/pci0000:00/0000:00:1c.0/0000:3b:00.0\0ACTION=add\0DEVPATH=/devices/pci0000:00/0000:00:1c.0/0000:3b:00.0\0SUBSYSTEM=pci\0PCI_CLASS=30200\0PCI_ID=10DE:2330\0PCI_SUBSYS_ID=10DE:16C1\0PCI_SLOT_NAME=0000:3b:00.0\0MODALIAS=pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00\0SEQNUM=4711\0";

    #[test]
    fn real_messages_parse() {
        let e = parse(LO).expect("lo");
        assert_eq!((e.action.as_str(), e.devpath.as_str()), ("change", "/devices/virtual/net/lo"));
        assert_eq!(e.subsystem.as_deref(), Some("net"));
        assert_eq!(e.seqnum, Some(820));
        assert_eq!(e.get("INTERFACE"), Some("lo"));
        assert_eq!(e.fields.len(), 7);
        let e = parse(NODE).expect("node");
        assert_eq!(e.subsystem.as_deref(), Some("node"));
        let e = parse(PCI_ADD).expect("pci");
        assert_eq!(e.action, "add");
        assert_eq!(e.get("PCI_SLOT_NAME"), Some("0000:3b:00.0"));
        assert_eq!(e.seqnum, Some(4711));
        // Without the final NUL too.
        assert_eq!(parse(&LO[..LO.len() - 1]).expect("no final nul"), parse(LO).expect("lo"));
        // A header alone.
        let e = parse(b"remove@/devices/x\0").expect("bare");
        assert_eq!((e.subsystem, e.seqnum, e.fields.len()), (None, None, 0));
    }

    #[test]
    fn defects_are_typed_errors() {
        assert_eq!(parse(b""), Err(ParseError::Empty));
        assert_eq!(parse(&vec![b'a'; MAX_MESSAGE + 1]), Err(ParseError::TooLong(MAX_MESSAGE + 1)));
        assert_eq!(parse(b"libudev\0\xfe\xed\xca\xfe"), Err(ParseError::Udev));
        assert!(matches!(parse(b"change/devices/x\0"), Err(ParseError::BadHeader(_))));
        assert!(matches!(parse(b"@/devices/x\0"), Err(ParseError::BadHeader(_))));
        assert!(matches!(parse(b"change@devices\0"), Err(ParseError::BadHeader(_))));
        assert!(matches!(parse(b"CHANGE@/d\0"), Err(ParseError::BadHeader(_))));
        assert_eq!(parse(b"change@/d\0A=\xff\0"), Err(ParseError::NotUtf8(1)));
        assert_eq!(parse(b"\xff@/d\0"), Err(ParseError::NotUtf8(0)));
        assert_eq!(parse(b"change@/d\0NOEQUALS\0"), Err(ParseError::BadField { index: 1, text: "NOEQUALS".into() }));
        assert!(matches!(parse(b"change@/d\0=v\0"), Err(ParseError::BadField { index: 1, .. })));
        assert!(matches!(parse(b"change@/d\0A=1\0\0B=2\0"), Err(ParseError::BadField { index: 2, .. })));
        assert!(matches!(parse(b"change@/d\0K Y=v\0"), Err(ParseError::BadField { .. })));
        assert!(matches!(parse(b"change@/d\0ACTION=add\0"), Err(ParseError::Mismatch { key: "ACTION", .. })));
        assert!(matches!(parse(b"change@/d\0DEVPATH=/e\0"), Err(ParseError::Mismatch { key: "DEVPATH", .. })));
        assert_eq!(parse(b"add@/d\0SEQNUM=x1\0"), Err(ParseError::BadSeqnum("x1".into())));
        let many: Vec<u8> = b"add@/d\0"
            .iter()
            .copied()
            .chain((0..=MAX_FIELDS).flat_map(|i| format!("K{i}=v\0").into_bytes()))
            .collect();
        assert!(many.len() <= MAX_MESSAGE);
        assert_eq!(parse(&many), Err(ParseError::TooManyFields));
        // Quoted text is bounded.
        let long = format!("change@/d\0{}\0", "x".repeat(4000));
        let Err(ParseError::BadField { text, .. }) = parse(long.as_bytes()) else { panic!() };
        assert_eq!(text.len(), QUOTE);
    }
}
