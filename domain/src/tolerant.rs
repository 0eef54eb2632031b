//! Reading records a newer node wrote. Records of one format version may gain fields and
//! kinds: a node of an older build ignores a field it does not know, lists an unknown
//! device kind as `other`, and leaves out an element of a list whose kind it does not know
//! (a link, a memory resource, a fabric group, a placed range), logging what it left out,
//! rather than refusing the whole record and losing the node. Any other fault of an
//! element still refuses the record, and everything this build knows is checked as
//! strictly as ever. Records that nodes read, change and write back (slots, shares,
//! partitions) and the domain's settings stay strict: dropping what a newer node wrote
//! there would lose it, or ignore a rule the domain set (a change an older build must not
//! ignore takes a new format version, which it refuses).

use fabric_topology::DeviceKind;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

/// Whether `e` says a kind (an enum's variant, a link's `type`) is one this build does not
/// know.
fn unknown_kind(e: &serde_json::Error) -> bool {
    e.to_string().starts_with("unknown variant")
}

/// A list whose elements of a kind this build does not know are left out; any other fault
/// of an element refuses the list.
pub fn known<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let raw = Vec::<serde_json::Value>::deserialize(d)?;
    let mut out = Vec::with_capacity(raw.len());
    for value in raw {
        match T::deserialize(value) {
            Ok(t) => out.push(t),
            Err(e) if unknown_kind(&e) => {
                tracing::info!(reason = %e, "left out an element of a kind this build does not know (a newer node's)");
            }
            Err(e) => return Err(serde::de::Error::custom(e)),
        }
    }
    Ok(out)
}

/// A device kind; one this build does not know is [`DeviceKind::Other`].
pub fn device_kind<'de, D: Deserializer<'de>>(d: D) -> Result<DeviceKind, D::Error> {
    let text = String::deserialize(d)?;
    let de = serde::de::value::StrDeserializer::<serde::de::value::Error>::new(&text);
    Ok(DeviceKind::deserialize(de).unwrap_or_else(|_| {
        tracing::info!(kind = %text.escape_debug(), "a device kind this build does not know (a newer node's): shown as other");
        DeviceKind::Other
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use fabric_topology::LinkKind;
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    struct Links {
        #[serde(deserialize_with = "known")]
        links: Vec<LinkKind>,
        #[serde(deserialize_with = "device_kind")]
        kind: DeviceKind,
    }

    #[test]
    fn unknown_kinds_are_left_out_or_other_and_other_faults_refuse() {
        let text =
            r#"{"links":[{"type":"smp"},{"type":"photonic","lambda":3},{"type":"xgmi","count":2}],"kind":"qpu"}"#;
        let l: Links = serde_json::from_str(text).unwrap();
        assert_eq!(l.links, [LinkKind::Smp, LinkKind::Xgmi { count: 2 }]);
        assert_eq!(l.kind, DeviceKind::Other);
        let known: Links = serde_json::from_str(r#"{"links":[],"kind":"gpu"}"#).unwrap();
        assert_eq!(known.kind, DeviceKind::Gpu);
        // A known kind of the wrong shape, a kind that is no string: refused.
        assert!(serde_json::from_str::<Links>(r#"{"links":[{"type":"xgmi","count":"two"}],"kind":"gpu"}"#).is_err());
        assert!(serde_json::from_str::<Links>(r#"{"links":[{"count":2}],"kind":"gpu"}"#).is_err());
        assert!(serde_json::from_str::<Links>(r#"{"links":[],"kind":7}"#).is_err());
        assert!(serde_json::from_str::<Links>(r#"{"links":{"type":"smp"},"kind":"gpu"}"#).is_err());
    }
}
