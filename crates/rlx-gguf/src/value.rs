//! GGUF metadata values.

/// One metadata value. Arrays keep their element type so an empty array still says
/// what it would hold.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
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
    /// `uint64`.
    U64(u64),
    /// `int64`.
    I64(i64),
    /// `float32`.
    F32(f32),
    /// `float64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string (invalid UTF-8 is replaced, never rejected).
    String(String),
    /// An array of values of one type.
    Array(ValueType, Vec<Value>),
}

/// The type tag of a metadata value, as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    /// Tag 0.
    U8,
    /// Tag 1.
    I8,
    /// Tag 2.
    U16,
    /// Tag 3.
    I16,
    /// Tag 4.
    U32,
    /// Tag 5.
    I32,
    /// Tag 6.
    F32,
    /// Tag 7.
    Bool,
    /// Tag 8.
    String,
    /// Tag 9.
    Array,
    /// Tag 10.
    U64,
    /// Tag 11.
    I64,
    /// Tag 12.
    F64,
}

impl ValueType {
    /// The type of tag `tag`, if it is one.
    pub fn from_tag(tag: u32) -> Option<ValueType> {
        Some(match tag {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type occupies (a string or array holds at
    /// least its 8-byte length), used to bound counts by the bytes left.
    pub fn min_size(self) -> usize {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 12,
        }
    }
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
        }
    }

    /// Any integer value that fits in `u64` (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value as `i64` (a `u64` above `i64::MAX` does not fit).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I64(v) => Some(v),
            _ => self.as_u64().map(|v| v as i64).or(match *self {
                Value::I8(v) => Some(v.into()),
                Value::I16(v) => Some(v.into()),
                Value::I32(v) => Some(v.into()),
                _ => None,
            }),
        }
    }

    /// Any float (or integer) value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array's elements.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }
}
