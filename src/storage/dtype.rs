//! Mapping data types onto zarrs, including the `float8_e4m3fn` data type zarrs lacks.

use std::sync::Arc;

use zarrs::array::{DataType, FillValue, FillValueMetadata, data_type};
use zarrs::metadata::Configuration;
use zarrs::metadata::v3::MetadataV3;
use zarrs_data_type::{
    DataTypeFillValueError, DataTypeFillValueMetadataError, DataTypePluginV3, DataTypeTraits,
};
use zarrs_plugin::{PluginCreateError, ZarrVersion};

use crate::model::DType;

/// `float8_e4m3fn` (PyTorch's `torch.float8_e4m3fn`, OCP FP8 E4M3: finite only, max 448).
/// Elements are opaque bytes to zarrs; the fill value is the byte 0 (+0.0).
#[derive(Debug)]
pub struct Float8E4M3FN;

zarrs_plugin::impl_extension_aliases!(Float8E4M3FN, v3: "float8_e4m3fn");

impl zarrs_data_type::DataTypeTraitsV3 for Float8E4M3FN {
    fn create(metadata: &MetadataV3) -> Result<DataType, PluginCreateError> {
        metadata.to_typed_configuration::<zarrs_metadata::EmptyConfiguration>()?;
        Ok(Arc::new(Float8E4M3FN).into())
    }
}

inventory::submit! {
    DataTypePluginV3::new::<Float8E4M3FN>()
}

impl DataTypeTraits for Float8E4M3FN {
    fn configuration(&self, _version: ZarrVersion) -> Configuration {
        Configuration::default()
    }

    fn fill_value(
        &self,
        fill: &FillValueMetadata,
        _version: ZarrVersion,
    ) -> Result<FillValue, DataTypeFillValueMetadataError> {
        if let Some(s) = fill.as_str()
            && let Some(hex) = s.strip_prefix("0x")
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            return Ok(FillValue::from(b));
        }
        // Numbers and "NaN" as tensorstore writes them, when exactly representable.
        let json = serde_json::to_value(fill).map_err(|_| DataTypeFillValueMetadataError)?;
        crate::model::dtype::float8_bits(DType::Float8E4M3FN, &json)
            .map(FillValue::from)
            .ok_or(DataTypeFillValueMetadataError)
    }

    fn metadata_fill_value(
        &self,
        fill: &FillValue,
    ) -> Result<FillValueMetadata, DataTypeFillValueError> {
        match fill.as_ne_bytes() {
            [0] => Ok(FillValueMetadata::from(0.0f64)),
            [b] => Ok(FillValueMetadata::from(format!("0x{b:02x}"))),
            _ => Err(DataTypeFillValueError),
        }
    }

    fn size(&self) -> zarrs::array::DataTypeSize {
        zarrs::array::DataTypeSize::Fixed(1)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

zarrs_data_type::codec_traits::impl_bytes_data_type_traits!(Float8E4M3FN, 1);

/// The zarrs data type for a [`DType`].
#[must_use]
pub fn to_zarrs(d: DType) -> DataType {
    match d {
        DType::Bool => data_type::bool(),
        DType::Int8 => data_type::int8(),
        DType::Int16 => data_type::int16(),
        DType::Int32 => data_type::int32(),
        DType::Int64 => data_type::int64(),
        DType::UInt8 => data_type::uint8(),
        DType::UInt16 => data_type::uint16(),
        DType::UInt32 => data_type::uint32(),
        DType::UInt64 => data_type::uint64(),
        DType::Float16 => data_type::float16(),
        DType::BFloat16 => data_type::bfloat16(),
        DType::Float32 => data_type::float32(),
        DType::Float64 => data_type::float64(),
        DType::Float8E4M3FN => Arc::new(Float8E4M3FN).into(),
        DType::Float8E5M2 => data_type::float8_e5m2(),
    }
}

/// The zero fill value of a data type (all bytes zero).
#[must_use]
pub fn zero_fill(d: DType) -> FillValue {
    FillValue::new(vec![0u8; d.size()])
}
