//! Events a subscriber receives: devices, links, the address map, and revocations of
//! imports it holds. Each travels as an `EVENT` frame under the `Subscribe` opcode.

use std::fmt;

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize, Serializer};

use super::bounded::{DeviceName, ErrorText, Name};
use super::response::ErrorCode;

/// A set of event topics.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Topics(u8);

impl Topics {
    /// No topics.
    pub const NONE: Topics = Topics(0);
    /// Devices added, removed, failed.
    pub const DEVICE: Topics = Topics(1 << 0);
    /// Links up, down, degraded.
    pub const LINK: Topics = Topics(1 << 1);
    /// Address map changes.
    pub const MAP: Topics = Topics(1 << 2);
    /// Revocations of the subscriber's imports.
    pub const REVOCATION: Topics = Topics(1 << 3);
    /// Every topic.
    pub const ALL: Topics = Topics(0b1111);

    /// The topics of these bits, if all are known.
    pub const fn from_bits(bits: u8) -> Option<Topics> {
        if bits & !Self::ALL.0 == 0 { Some(Topics(bits)) } else { None }
    }

    /// The bits.
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Whether every topic of `other` is in `self`.
    pub const fn contains(self, other: Topics) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets together.
    pub const fn union(self, other: Topics) -> Topics {
        Topics(self.0 | other.0)
    }
}

impl fmt::Debug for Topics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names =
            [(Self::DEVICE, "device"), (Self::LINK, "link"), (Self::MAP, "map"), (Self::REVOCATION, "revocation")];
        let mut set = f.debug_set();
        for (t, name) in names {
            if self.contains(t) {
                set.entry(&format_args!("{name}"));
            }
        }
        set.finish()
    }
}

impl Serialize for Topics {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(self.0)
    }
}

impl<'de> Deserialize<'de> for Topics {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bits = u8::deserialize(d)?;
        Topics::from_bits(bits)
            .ok_or_else(|| de::Error::invalid_value(de::Unexpected::Unsigned(bits.into()), &"known topic bits"))
    }
}

/// What happened to a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceChange {
    /// Discovered.
    Added,
    /// Vanished (its memory becomes a hole in the map).
    Removed,
    /// Reports a failure.
    Failed,
    /// Back to normal.
    Recovered,
}

/// What happened to a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LinkChange {
    /// Up at full bandwidth.
    Up,
    /// Down.
    Down,
    /// Up below its maximum bandwidth.
    Degraded {
        /// Bandwidth left, in thousandths.
        bandwidth_permille: u16,
    },
}

/// The address map changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MapChange {
    /// New generation.
    pub generation: u64,
    /// Ranges added.
    pub added: u32,
    /// Ranges that became holes.
    pub holed: u32,
    /// Ranges removed.
    pub removed: u32,
}

/// Why an import ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RevocationReason {
    /// The owner revoked the export.
    Revoked,
    /// The owner freed the region.
    Freed,
    /// The owner's process exited.
    OwnerExited,
    /// The device holding the memory vanished.
    DeviceLost,
}

/// An import of the subscriber's ended; its mapping must no longer be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Revocation {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// The subscriber's import.
    pub import: u64,
    /// Why.
    pub reason: RevocationReason,
}

/// How a copy ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CopyResult {
    /// Every byte was copied.
    Ok,
    /// The copy stopped: the code says why (`NotFound` when an endpoint went away
    /// during the copy, `Internal` for an I/O failure), the message in words.
    Failed {
        /// Why, as a code.
        code: ErrorCode,
        /// Why, in words.
        message: ErrorText,
    },
}

/// A copy of the receiving session finished (since 1.2). Sent to the session that asked
/// for the copy, subscribed or not, under the `Copy` request's id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyDone {
    /// The copy id the `Copy` response gave.
    pub copy: u64,
    /// How it ended.
    pub result: CopyResult,
    /// Bytes known copied (all of them on success; on failure a count of whole chunks
    /// done, not a prefix: chunks run in parallel).
    pub bytes: u64,
}

/// An event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// A device changed.
    Device {
        /// Identity.
        device: DeviceName,
        /// What happened.
        change: DeviceChange,
    },
    /// A link changed.
    Link {
        /// One end (upstream for hierarchical links).
        a: DeviceName,
        /// Other end.
        b: DeviceName,
        /// Link kind (`nvlink`, `pcie`...).
        kind: Name,
        /// What happened.
        change: LinkChange,
    },
    /// The address map changed.
    Map(MapChange),
    /// An import was revoked.
    Revocation(Revocation),
    /// A copy finished (since 1.2; not a topic: see [`CopyDone`]).
    CopyDone(CopyDone),
}

impl Event {
    /// The topic a subscriber needs to receive this event ([`Topics::NONE`] for
    /// [`Event::CopyDone`], which is not published to subscribers).
    pub fn topic(&self) -> Topics {
        match self {
            Event::Device { .. } => Topics::DEVICE,
            Event::Link { .. } => Topics::LINK,
            Event::Map(_) => Topics::MAP,
            Event::Revocation(_) => Topics::REVOCATION,
            // Delivered to its session directly, never through subscriptions.
            Event::CopyDone(_) => Topics::NONE,
        }
    }
}
