//! Strings and lists with a maximum length that holds on both sides of the wire: they
//! cannot be built too long, and decoding refuses a longer one before allocating it.

use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeSeq, Serializer};

/// A value longer than its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BoundedError {
    /// Too many bytes or elements.
    #[error("length {len} exceeds {max}")]
    TooLong {
        /// Actual length.
        len: usize,
        /// Bound.
        max: usize,
    },
}

/// A UTF-8 string of at most `MAX` bytes.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BoundedString<const MAX: usize>(String);

/// A short name: partitions, clients, schemas (at most 64 bytes).
pub type Name = BoundedString<64>;
/// A device identity in its text form (`uuid:...`, `pci:NODE/ADDR`...), at most 256 bytes.
pub type DeviceName = BoundedString<256>;
/// A human-readable message or detail, at most 1,024 bytes.
pub type ErrorText = BoundedString<1024>;

impl<const MAX: usize> BoundedString<MAX> {
    /// The bound.
    pub const MAX: usize = MAX;

    /// `s`, when it fits.
    pub fn new(s: impl Into<String>) -> Result<Self, BoundedError> {
        let s = s.into();
        if s.len() > MAX {
            return Err(BoundedError::TooLong { len: s.len(), max: MAX });
        }
        Ok(Self(s))
    }

    /// `s`, cut at a character boundary to fit (for messages built from arbitrary text).
    pub fn truncated(s: &str) -> Self {
        let mut end = s.len().min(MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        Self(s[..end].to_owned())
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The owned text.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl<const MAX: usize> Deref for BoundedString<MAX> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<const MAX: usize> TryFrom<&str> for BoundedString<MAX> {
    type Error = BoundedError;
    fn try_from(s: &str) -> Result<Self, BoundedError> {
        Self::new(s)
    }
}

impl<const MAX: usize> TryFrom<String> for BoundedString<MAX> {
    type Error = BoundedError;
    fn try_from(s: String) -> Result<Self, BoundedError> {
        Self::new(s)
    }
}

impl<const MAX: usize> fmt::Debug for BoundedString<MAX> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl<const MAX: usize> fmt::Display for BoundedString<MAX> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<const MAX: usize> Serialize for BoundedString<MAX> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de, const MAX: usize> Deserialize<'de> for BoundedString<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<const MAX: usize>;
        impl<const MAX: usize> Visitor<'_> for V<MAX> {
            type Value = BoundedString<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a string of at most {MAX} bytes")
            }
            // The length is checked on the borrowed input, before the copy.
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                BoundedString::new(s).map_err(|_| E::invalid_length(s.len(), &self))
            }
        }
        d.deserialize_str(V::<MAX>)
    }
}

/// Elements reserved up front when decoding a list; the rest grow as elements arrive, so
/// a forged count costs nothing.
const PREALLOC: usize = 16;

/// A list of at most `MAX` elements.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BoundedVec<T, const MAX: usize>(Vec<T>);

impl<T, const MAX: usize> Default for BoundedVec<T, MAX> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T, const MAX: usize> BoundedVec<T, MAX> {
    /// The bound.
    pub const MAX: usize = MAX;

    /// `v`, when it fits.
    pub fn new(v: Vec<T>) -> Result<Self, BoundedError> {
        if v.len() > MAX {
            return Err(BoundedError::TooLong { len: v.len(), max: MAX });
        }
        Ok(Self(v))
    }

    /// The elements.
    pub fn as_slice(&self) -> &[T] {
        &self.0
    }

    /// The owned elements.
    pub fn into_vec(self) -> Vec<T> {
        self.0
    }
}

impl<T, const MAX: usize> Deref for BoundedVec<T, MAX> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T, const MAX: usize> TryFrom<Vec<T>> for BoundedVec<T, MAX> {
    type Error = BoundedError;
    fn try_from(v: Vec<T>) -> Result<Self, BoundedError> {
        Self::new(v)
    }
}

impl<T: Serialize, const MAX: usize> Serialize for BoundedVec<T, MAX> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for item in &self.0 {
            seq.serialize_element(item)?;
        }
        seq.end()
    }
}

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for BoundedVec<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T, const MAX: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for V<T, MAX> {
            type Value = BoundedVec<T, MAX>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a list of at most {MAX} elements")
            }
            // The announced length is checked before anything is reserved, the reservation
            // is small whatever is announced, and no more than MAX elements are pushed.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let hint = seq.size_hint().unwrap_or(0);
                if hint > MAX {
                    return Err(de::Error::invalid_length(hint, &self));
                }
                let mut v = Vec::with_capacity(hint.min(PREALLOC));
                while let Some(item) = seq.next_element()? {
                    if v.len() == MAX {
                        return Err(de::Error::invalid_length(MAX + 1, &self));
                    }
                    v.push(item);
                }
                Ok(BoundedVec(v))
            }
        }
        d.deserialize_seq(V::<T, MAX>(PhantomData))
    }
}
