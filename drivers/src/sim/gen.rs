//! Generators: name patterns with `{i}`/`{j}` placeholders, deterministic UUIDs and serials
//! from a stable hash, and byte sizes with units.
//!
//! Nothing here is random: the same fabric name, node and device name always give the same
//! UUID, so the same file always gives the same inventory.

use std::fmt::Write as _;

/// Most instances one generator (`count`, `i` x `j`, cluster `nodes`) may produce. Keeps a
/// hostile or mistyped config from allocating without bound.
pub(crate) const MAX_COUNT: i64 = 1_000_000;

/// An arithmetic operation in a placeholder (`{i/2}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// `{VAR}` or `{VAR OP K OP K…}` (left to right); `var` is `i` or `j`.
    Var {
        var: u8,
        ops: Vec<(Op, u64)>,
        hex: bool,
        width: usize,
    },
}

/// A name with placeholders: `gpu{i}`, `sw{i/2}`, `tray{j%9}`, `bus{i*2+16:x}`. A
/// placeholder is `{VAR}` or `{VAR OP K ...}` with VAR `i` or `j`, each OP one of
/// `+ - * / %` applied left to right, K a decimal integer, and an optional format: `:x`
/// (hexadecimal), `:02x` / `:03` (zero-padded). `{{` and `}}` are literal braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pattern {
    pieces: Vec<Piece>,
}

impl Pattern {
    /// Parses a pattern; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut lit = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    lit.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    lit.push('}');
                }
                '{' => {
                    let mut inner = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some(c) => inner.push(c),
                            None => return Err(format!("unclosed placeholder in {text:?}")),
                        }
                    }
                    if !lit.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut lit)));
                    }
                    pieces.push(parse_placeholder(&inner)?);
                }
                '}' => return Err(format!("unmatched '}}' in {text:?}")),
                c => lit.push(c),
            }
        }
        if !lit.is_empty() {
            pieces.push(Piece::Text(lit));
        }
        Ok(Self { pieces })
    }

    /// Whether the pattern has any placeholder.
    pub fn is_literal(&self) -> bool {
        self.pieces.iter().all(|p| matches!(p, Piece::Text(_)))
    }

    /// Renders the pattern for indexes `i` and `j` into `out` (cleared first).
    pub fn render_into(&self, i: u64, j: u64, out: &mut String) -> Result<(), String> {
        out.clear();
        for p in &self.pieces {
            match p {
                Piece::Text(t) => out.push_str(t),
                Piece::Var { var, ops, hex, width } => {
                    let x = if *var == b'i' { i } else { j };
                    let mut v = Some(x);
                    for &(op, k) in ops {
                        v = v.and_then(|v| match op {
                            Op::Add => v.checked_add(k),
                            Op::Sub => v.checked_sub(k),
                            Op::Mul => v.checked_mul(k),
                            Op::Div => v.checked_div(k),
                            Op::Rem => v.checked_rem(k),
                        });
                    }
                    let v = v.ok_or_else(|| format!("placeholder out of range for {}={x}", *var as char))?;
                    // Writing to a String cannot fail.
                    let _ = if *hex { write!(out, "{v:0width$x}") } else { write!(out, "{v:0width$}") };
                }
            }
        }
        Ok(())
    }

    /// Renders into a new string.
    pub fn render(&self, i: u64, j: u64) -> Result<String, String> {
        let mut s = String::new();
        self.render_into(i, j, &mut s)?;
        Ok(s)
    }
}

fn parse_placeholder(inner: &str) -> Result<Piece, String> {
    let bad = || {
        format!("bad placeholder {{{inner}}} (expected i or j, then +K -K *K /K %K, then optionally :x, :04x or :03)")
    };
    let (expr, hex, width) = match inner.split_once(':') {
        Some((e, fmt)) => {
            let (digits, hex) = fmt.strip_suffix('x').map_or((fmt, false), |d| (d, true));
            let width = if digits.is_empty() { 0 } else { digits.parse().map_err(|_| bad())? };
            if !digits.is_empty() && !digits.starts_with('0') || width > 16 {
                return Err(bad());
            }
            (e, hex, width)
        }
        None => (inner, false, 0),
    };
    let expr: String = expr.chars().filter(|c| !c.is_whitespace()).collect();
    let mut chars = expr.chars();
    let var = match chars.next() {
        Some('i') => b'i',
        Some('j') => b'j',
        _ => return Err(bad()),
    };
    let mut rest = chars.as_str();
    let mut ops = Vec::new();
    while !rest.is_empty() {
        let op = match rest.as_bytes()[0] {
            b'+' => Op::Add,
            b'-' => Op::Sub,
            b'*' => Op::Mul,
            b'/' => Op::Div,
            b'%' => Op::Rem,
            _ => return Err(bad()),
        };
        let digits = rest[1..].find(|c: char| !c.is_ascii_digit()).map_or(rest.len(), |p| p + 1);
        let k: u64 = rest[1..digits].parse().map_err(|_| bad())?;
        if k == 0 && matches!(op, Op::Div | Op::Rem) {
            return Err(format!("division by zero in {{{inner}}}"));
        }
        if ops.len() >= 8 {
            return Err(bad());
        }
        ops.push((op, k));
        rest = &rest[digits..];
    }
    Ok(Piece::Var { var, ops, hex, width })
}

/// Checks that a rendered name can be part of a device identity: non-empty, at most 128
/// bytes, letters, digits and `_ - . : +`. `/` is reserved for `NODE/NAME` paths.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'+'));
    if ok {
        Ok(())
    } else {
        Err(format!("invalid name {name:?} (use letters, digits and _ - . : +, at most 128 bytes)"))
    }
}

/// 128-bit FNV-1a over parts separated by a 0xff byte (which never occurs in UTF-8), so
/// `("ab", "c")` and `("a", "bc")` differ. Stable across platforms and Rust releases.
pub(crate) fn stable_hash(parts: &[&str]) -> u128 {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h = OFFSET;
    for (n, p) in parts.iter().enumerate() {
        if n > 0 {
            h ^= 0xff;
            h = h.wrapping_mul(PRIME);
        }
        for &b in p.as_bytes() {
            h ^= u128::from(b);
            h = h.wrapping_mul(PRIME);
        }
    }
    // FNV mixes poorly for inputs that differ only at the end: finish with fmix64
    // (MurmurHash3) on both halves, each feeding the other.
    let hi = fmix64((h >> 64) as u64);
    let lo = fmix64(h as u64 ^ hi);
    let hi = fmix64(hi ^ lo.rotate_left(17));
    (u128::from(hi) << 64) | u128::from(lo)
}

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// A deterministic UUID-shaped string (version 8, RFC 9562 variant) for a GPU.
pub(crate) fn gpu_uuid(fabric: &str, node: &str, device: &str) -> String {
    let mut h = stable_hash(&[fabric, node, device]);
    h = (h & !(0xf << 76)) | (0x8 << 76);
    h = (h & !(0x3 << 62)) | (0x2 << 62);
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (n, &(from, to)) in [(0u32, 8u32), (8, 12), (12, 16), (16, 20), (20, 32)].iter().enumerate() {
        if n > 0 {
            s.push('-');
        }
        for nibble in from..to {
            let v = (h >> (124 - 4 * nibble)) & 0xf;
            s.push(char::from_digit(v as u32, 16).unwrap_or('0'));
        }
    }
    s
}

/// A deterministic non-zero 64-bit serial (CXL memdev DSN) for a device.
pub(crate) fn serial(fabric: &str, node: &str, device: &str) -> u64 {
    let h = stable_hash(&[fabric, node, device, "serial"]);
    ((h >> 64) as u64 ^ h as u64) | 1
}

/// Parses a byte size: an integer, or a string `N UNIT` with UNIT one of B, KiB, MiB, GiB,
/// TiB, PiB (powers of 1024) or KB, MB, GB, TB, PB (powers of 1000).
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("invalid size {text:?} (expected e.g. \"80GiB\")"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "PiB" => 1 << 50,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "PB" => 1_000_000_000_000_000,
        u => return Err(format!("unknown size unit {u:?} in {text:?} (use B, KiB, MiB, GiB, TiB, PiB, KB..PB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {text:?} overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_render_arithmetic_and_hex() {
        let p = Pattern::parse("sw{i/2}-p{i%2}-{j+1}-{i*16:x}{{x}}-{i%2+8}").unwrap();
        assert_eq!(p.render(3, 4).unwrap(), "sw1-p1-5-30{x}-9");
        assert!(Pattern::parse("plain").unwrap().is_literal());
        let p = Pattern::parse("{i:02x}.{i:03}").unwrap();
        assert_eq!(p.render(10, 0).unwrap(), "0a.010");
        for bad in ["{k}", "{i", "a}", "{i/0}", "{i^2}", "{i:y}", "{i+}", "{i:2x}", "{i:099}"] {
            assert!(Pattern::parse(bad).is_err(), "{bad}");
        }
        assert!(Pattern::parse("{i-1}").unwrap().render(0, 0).is_err());
    }

    #[test]
    fn uuids_are_stable_distinct_and_well_formed() {
        let a = gpu_uuid("f", "node0", "gpu0");
        assert_eq!(a, gpu_uuid("f", "node0", "gpu0"));
        assert_ne!(a, gpu_uuid("f", "node0", "gpu1"));
        assert_ne!(a, gpu_uuid("f", "node1", "gpu0"));
        assert_ne!(gpu_uuid("f", "ab", "c"), gpu_uuid("f", "a", "bc"));
        assert_eq!(a.len(), 40);
        assert_eq!(&a[18..19], "8", "version nibble in {a}");
        assert!(matches!(&a[23..24], "8" | "9" | "a" | "b"), "variant in {a}");
    }

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size("2 TB"), Ok(2_000_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("1.5GiB").is_err());
        assert!(parse_size("99999999999PiB").is_err());
        assert!(parse_size("GiB").is_err());
    }

    #[test]
    fn names_reject_separators_and_spaces() {
        assert!(check_name("gpu0").is_ok());
        assert!(check_name("pci0000:15").is_ok());
        for bad in ["", "a/b", "a b", "é"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
