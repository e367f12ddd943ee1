//! Runs one generic slice routine on whichever dtype a host tensor holds.

/// `map_data!(data, v => expr)` evaluates `expr` with `v` bound to the typed element vector and
/// wraps the result in the same [`kda_core::TensorData`] variant.
macro_rules! map_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            kda_core::TensorData::F64($v) => kda_core::TensorData::F64($body),
            kda_core::TensorData::F32($v) => kda_core::TensorData::F32($body),
            kda_core::TensorData::BF16($v) => kda_core::TensorData::BF16($body),
        }
    };
}

pub(crate) use map_data;
