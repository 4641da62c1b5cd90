//! GGUF metadata values.

use std::fmt;

/// The type tag of a GGUF metadata value (`gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    /// `uint8` (tag 0).
    U8,
    /// `int8` (tag 1).
    I8,
    /// `uint16` (tag 2).
    U16,
    /// `int16` (tag 3).
    I16,
    /// `uint32` (tag 4).
    U32,
    /// `int32` (tag 5).
    I32,
    /// `float32` (tag 6).
    F32,
    /// `bool` (tag 7), one byte that must be 0 or 1.
    Bool,
    /// `string` (tag 8): u64 length and UTF-8 bytes.
    String,
    /// `array` (tag 9): u32 item type, u64 count, items.
    Array,
    /// `uint64` (tag 10).
    U64,
    /// `int64` (tag 11).
    I64,
    /// `float64` (tag 12).
    F64,
}

impl GgufValueType {
    /// The type for a tag, or `None` for unknown tags.
    pub fn from_tag(tag: u32) -> Option<GgufValueType> {
        Some(match tag {
            0 => GgufValueType::U8,
            1 => GgufValueType::I8,
            2 => GgufValueType::U16,
            3 => GgufValueType::I16,
            4 => GgufValueType::U32,
            5 => GgufValueType::I32,
            6 => GgufValueType::F32,
            7 => GgufValueType::Bool,
            8 => GgufValueType::String,
            9 => GgufValueType::Array,
            10 => GgufValueType::U64,
            11 => GgufValueType::I64,
            12 => GgufValueType::F64,
            _ => return None,
        })
    }

    /// The tag written to files.
    pub fn tag(self) -> u32 {
        match self {
            GgufValueType::U8 => 0,
            GgufValueType::I8 => 1,
            GgufValueType::U16 => 2,
            GgufValueType::I16 => 3,
            GgufValueType::U32 => 4,
            GgufValueType::I32 => 5,
            GgufValueType::F32 => 6,
            GgufValueType::Bool => 7,
            GgufValueType::String => 8,
            GgufValueType::Array => 9,
            GgufValueType::U64 => 10,
            GgufValueType::I64 => 11,
            GgufValueType::F64 => 12,
        }
    }

    /// The smallest number of bytes a value of this type takes in a file (its exact size for
    /// fixed-size types).
    pub fn min_encoded_size(self) -> usize {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 => 8,
            GgufValueType::String => 8,
            GgufValueType::Array => 12,
        }
    }

    /// The lower-case name used in messages (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgufValueType::U8 => "u8",
            GgufValueType::I8 => "i8",
            GgufValueType::U16 => "u16",
            GgufValueType::I16 => "i16",
            GgufValueType::U32 => "u32",
            GgufValueType::I32 => "i32",
            GgufValueType::F32 => "f32",
            GgufValueType::Bool => "bool",
            GgufValueType::String => "string",
            GgufValueType::Array => "array",
            GgufValueType::U64 => "u64",
            GgufValueType::I64 => "i64",
            GgufValueType::F64 => "f64",
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `uint8`.
    U8(u8),
    /// `int8`.
    I8(i8),
    /// `uint16`.
    U16(u16),
    /// `int16`.
    I16(i16),
    /// `uint32`.
    U32(u32),
    /// `int32`.
    I32(i32),
    /// `float32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// `string` (invalid UTF-8 in a file is replaced by U+FFFD when read).
    String(String),
    /// `array`: items all of `item_type` (arrays may nest).
    Array {
        /// The declared type of every item.
        item_type: GgufValueType,
        /// The items.
        items: Vec<GgufValue>,
    },
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float64`.
    F64(f64),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array { .. } => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// An array of `item_type` items (the caller keeps the items of that type).
    pub fn array(item_type: GgufValueType, items: Vec<GgufValue>) -> GgufValue {
        GgufValue::Array { item_type, items }
    }

    /// An array of strings.
    pub fn string_array<S: Into<String>>(items: impl IntoIterator<Item = S>) -> GgufValue {
        GgufValue::array(GgufValueType::String, items.into_iter().map(|s| GgufValue::String(s.into())).collect())
    }

    /// Any integer value as `i128` (lossless for every integer type); `None` for other types.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// An integer value that fits in `u64` (any integer type); `None` otherwise.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// An integer value that fits in `u32` (any integer type); `None` otherwise.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// An integer value that fits in `i64` (any integer type); `None` otherwise.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// An integer value that fits in `i32` (any integer type); `None` otherwise.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }

    /// A float value (`f32` widened, or `f64`); `None` for other types.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// A float value as `f32` (`f64` values are rounded); `None` for other types.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A `bool` value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A `string` value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The items of an array value.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array { items, .. } => Some(items),
            _ => None,
        }
    }

    /// A short description for error messages: the type, and the value itself when it is small.
    pub fn describe(&self) -> String {
        match self {
            GgufValue::String(s) if s.chars().count() <= 40 => format!("string {s:?}"),
            GgufValue::String(s) => format!("string of {} bytes", s.len()),
            GgufValue::Array { item_type, items } => {
                format!("array of {} {item_type}", items.len())
            }
            GgufValue::Bool(b) => format!("bool {b}"),
            GgufValue::F32(v) => format!("f32 {v}"),
            GgufValue::F64(v) => format!("f64 {v}"),
            other => match other.as_i128() {
                Some(v) => format!("{} {v}", other.value_type()),
                None => other.value_type().to_string(),
            },
        }
    }
}

impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufValue::String(s) => write!(f, "{s:?}"),
            GgufValue::Bool(b) => write!(f, "{b}"),
            GgufValue::F32(v) => write!(f, "{v}"),
            GgufValue::F64(v) => write!(f, "{v}"),
            GgufValue::Array { items, .. } => {
                f.write_str("[")?;
                for (i, item) in items.iter().take(8).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                if items.len() > 8 {
                    write!(f, ", ... ({} items)", items.len())?;
                }
                f.write_str("]")
            }
            other => match other.as_i128() {
                Some(v) => write!(f, "{v}"),
                None => f.write_str("?"),
            },
        }
    }
}

/// A Rust type a metadata value converts to, for [`GgufFile::get`](super::GgufFile::get).
///
/// Integer targets accept any integer value that fits; float targets accept `f32` and `f64`;
/// `Vec<T>` accepts arrays whose items all convert.
pub trait FromGgufValue: Sized {
    /// What the conversion expects, for error messages (`"u32"`, `"array of string"`).
    fn expected() -> String;
    /// The converted value, or `None` when the value has another type or is out of range.
    fn from_gguf_value(value: &GgufValue) -> Option<Self>;
}

macro_rules! int_from_value {
    ($($t:ty),*) => {$(
        impl FromGgufValue for $t {
            fn expected() -> String {
                stringify!($t).to_string()
            }
            fn from_gguf_value(value: &GgufValue) -> Option<Self> {
                value.as_i128().and_then(|v| <$t>::try_from(v).ok())
            }
        }
    )*};
}
int_from_value!(u8, i8, u16, i16, u32, i32, u64, i64, usize);

impl FromGgufValue for f32 {
    fn expected() -> String {
        "f32".into()
    }
    fn from_gguf_value(value: &GgufValue) -> Option<Self> {
        value.as_f32()
    }
}

impl FromGgufValue for f64 {
    fn expected() -> String {
        "f64".into()
    }
    fn from_gguf_value(value: &GgufValue) -> Option<Self> {
        value.as_f64()
    }
}

impl FromGgufValue for bool {
    fn expected() -> String {
        "bool".into()
    }
    fn from_gguf_value(value: &GgufValue) -> Option<Self> {
        value.as_bool()
    }
}

impl FromGgufValue for String {
    fn expected() -> String {
        "string".into()
    }
    fn from_gguf_value(value: &GgufValue) -> Option<Self> {
        value.as_str().map(str::to_owned)
    }
}

impl<T: FromGgufValue> FromGgufValue for Vec<T> {
    fn expected() -> String {
        format!("array of {}", T::expected())
    }
    fn from_gguf_value(value: &GgufValue) -> Option<Self> {
        value.as_array()?.iter().map(T::from_gguf_value).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip() {
        for tag in 0..13 {
            let t = GgufValueType::from_tag(tag).expect("known tag");
            assert_eq!(t.tag(), tag);
        }
        assert_eq!(GgufValueType::from_tag(13), None);
    }

    #[test]
    fn integer_conversions_are_range_checked() {
        assert_eq!(GgufValue::I32(-1).as_u32(), None);
        assert_eq!(GgufValue::I32(7).as_u32(), Some(7));
        assert_eq!(GgufValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(GgufValue::U8(3).as_u64(), Some(3));
        assert_eq!(GgufValue::F32(1.0).as_u64(), None);
        assert_eq!(u16::from_gguf_value(&GgufValue::U32(70000)), None);
        let arr = GgufValue::array(GgufValueType::I32, vec![GgufValue::I32(1), GgufValue::I32(2)]);
        assert_eq!(Vec::<u32>::from_gguf_value(&arr), Some(vec![1, 2]));
        assert_eq!(Vec::<String>::from_gguf_value(&arr), None);
    }
}
