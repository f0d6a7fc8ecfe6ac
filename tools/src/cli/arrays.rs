//! Arrays in files for `flashgen run`: NumPy `.npy` (little-endian f64, f32,
//! f16, i32, i64, and `V2` for bf16 as `ml_dtypes` saves it; C order) and
//! raw little-endian files of a named element type, read into the f64 (or
//! i32) values the reference and the upload take; results written as
//! `.npy` f32.

use flashgen::codegen::reference::TensorData;
use flashgen::codegen::ElemTy;
use flashgen::half::{bf16, f16};
use std::path::Path;

const MAGIC: &[u8] = b"\x93NUMPY";

/// The values of the array in `path` with `len` elements: `.npy` by its
/// header (its element count must be `len`), anything else as raw `elem`s.
/// Integers come back as `TensorData::I32` (i64 values must fit), floats as
/// `TensorData::Float`.
pub fn read(path: &Path, elem: ElemTy, len: usize) -> Result<TensorData, String> {
    let shown = path.display();
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let (descr, body) = match bytes.starts_with(MAGIC) {
        true => npy_body(&bytes).map_err(|e| format!("{shown}: {e}"))?,
        false => (raw_descr(elem), &bytes[..]),
    };
    let size = match descr {
        "<f8" | "<i8" => 8,
        "<f4" | "<i4" => 4,
        "<f2" | "<V2" | "|V2" => 2,
        other => return Err(format!("{shown}: element type `{other}` is not one of f64, f32, f16, bf16, i32, i64")),
    };
    if Some(body.len()) != len.checked_mul(size) {
        return Err(format!("{shown}: holds {} elements, the shape needs {len}", body.len() / size));
    }
    let words = body.chunks_exact(size);
    let float = |f: fn(&[u8]) -> f64| TensorData::Float(words.clone().map(f).collect());
    Ok(match descr {
        "<f8" => float(|w| f64::from_le_bytes(w.try_into().unwrap_or_default())),
        "<f4" => float(|w| f32::from_le_bytes(w.try_into().unwrap_or_default()) as f64),
        "<f2" => float(|w| f16::from_le_bytes([w[0], w[1]]).to_f64()),
        "<V2" | "|V2" => float(|w| bf16::from_le_bytes([w[0], w[1]]).to_f64()),
        "<i4" => TensorData::I32(words.map(|w| i32::from_le_bytes(w.try_into().unwrap_or_default())).collect()),
        _ => TensorData::I32(
            words
                .map(|w| i32::try_from(i64::from_le_bytes(w.try_into().unwrap_or_default())))
                .collect::<Result<_, _>>()
                .map_err(|_| format!("{shown}: an i64 value does not fit an i32"))?,
        ),
    })
}

/// The NumPy descriptor a raw file of `elem`s is read as.
fn raw_descr(elem: ElemTy) -> &'static str {
    match elem {
        ElemTy::I32 => "<i4",
        ElemTy::F32 => "<f4",
        ElemTy::F16 => "<f2",
        ElemTy::Bf16 => "<V2",
    }
}

/// A `.npy` file's element descriptor and data, after its header.
fn npy_body(bytes: &[u8]) -> Result<(&str, &[u8]), String> {
    // The header's length: 2 bytes from offset 8 (version 1), else 4.
    let start = match bytes.get(6) {
        Some(1) => 10,
        Some(2 | 3) => 12,
        _ => return Err("an .npy version this reader does not know".into()),
    };
    let header_len = bytes.get(8..start).ok_or("a truncated .npy header")?;
    let header_len = header_len.iter().rev().fold(0usize, |n, &b| n << 8 | b as usize);
    let header = bytes.get(start..start + header_len).ok_or("a truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "an .npy header that is not text")?;
    if header.contains("'fortran_order': True") {
        return Err("Fortran order: save the array C-contiguous (np.ascontiguousarray)".into());
    }
    let descr = header
        .split("'descr':")
        .nth(1)
        .and_then(|rest| rest.split('\'').nth(1))
        .ok_or("an .npy header without 'descr'")?;
    Ok((descr, &bytes[start + header_len..]))
}

/// Writes `values` as an f32 `.npy` array of `shape`.
pub fn write_f32(path: &Path, shape: &[usize], values: &[f64]) -> Result<(), String> {
    let dims: Vec<String> = shape.iter().map(|d| format!("{d},")).collect();
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}), }}", dims.join(" "));
    // Data starts 64-byte aligned; the header ends with a newline.
    while !(MAGIC.len() + 4 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = [MAGIC, &[1, 0], &(header.len() as u16).to_le_bytes(), header.as_bytes()].concat();
    bytes.extend(values.iter().flat_map(|&x| (x as f32).to_le_bytes()));
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_files_round_trip_and_raw_files_take_the_declared_type() {
        let dir = std::env::temp_dir().join(format!("flashgen-arrays-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let npy = dir.join("a.npy");
        write_f32(&npy, &[2, 3], &[1.0, -2.5, 3.0, 0.0, 7.25, -1.0]).unwrap();
        let bytes = std::fs::read(&npy).unwrap();
        assert_eq!((bytes.len() - 6 * 4) % 64, 0, "data starts 64-byte aligned");
        let TensorData::Float(read_back) = read(&npy, ElemTy::Bf16, 6).unwrap() else { panic!("floats") };
        assert_eq!(read_back, [1.0, -2.5, 3.0, 0.0, 7.25, -1.0]);
        assert!(read(&npy, ElemTy::F32, 5).unwrap_err().contains("holds 6 elements, the shape needs 5"));
        let raw = dir.join("ids.bin");
        std::fs::write(&raw, [3i32, -1].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        assert!(matches!(read(&raw, ElemTy::I32, 2).unwrap(), TensorData::I32(ids) if ids == [3, -1]));
        std::fs::write(&npy, b"\x93NUMPY\x01\x00\x10\x00{'descr': '>f4'}").unwrap();
        assert!(read(&npy, ElemTy::F32, 0).unwrap_err().contains("`>f4` is not one of"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Truncated and corrupted files: an error naming the file, never a
    /// panic (every prefix of a valid file, and bytes of it overwritten).
    #[test]
    fn damaged_npy_files_are_errors() {
        let dir = std::env::temp_dir().join(format!("flashgen-arrays-damaged-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.npy");
        write_f32(&path, &[4], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let valid = std::fs::read(&path).unwrap();
        let mut damaged: Vec<Vec<u8>> = (0..valid.len()).map(|n| valid[..n].to_vec()).collect();
        for (at, byte) in [(6, 9), (6, 2), (8, 0xff), (9, 0xff), (10, b'"'), (20, 0xc3)] {
            let mut bytes = valid.clone();
            bytes[at] = byte;
            damaged.push(bytes);
        }
        for bytes in damaged {
            std::fs::write(&path, &bytes).unwrap();
            for len in [0, 4, usize::MAX] {
                if let Err(e) = read(&path, ElemTy::F32, len) {
                    assert!(e.starts_with(&path.display().to_string()), "{e}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
