//! Data type conversion on load (`Cast::FloatConvert`).
//!
//! * Bit for bit against numpy and ml_dtypes (`tests/python/convert_ref.py`): every `float16`
//!   and `bfloat16` pattern, and `float32` / `float64` inputs covering zeros, subnormals,
//!   infinities, NaNs with payloads (quiet and signalling), overflow to infinity, the largest
//!   finite values, and values at, just below and just above every rounding tie, converted to
//!   each other type. Non-NaN results must equal the library's bits, except `float64` to
//!   `bfloat16`, which ml_dtypes rounds twice (through `float32`) and which must equal the
//!   correctly rounded reference; NaN results must follow the documented NaN rule, and equal
//!   the library's bits for the usual quiet NaN.
//! * Real loads: a checkpoint saved in `float32` by 4 ranks, loaded into `bfloat16` (and
//!   `float16`, `float64`) targets with conversion by 3 ranks in another split and by boxes,
//!   equal to converting the saved data; without conversion the same request is still a
//!   `DtypeMismatch`.
//!
//! Python: `$ZARRCKPT_PYTHON`, else `<repo>/.venv/bin/python`, as the interop tests
//! (`ZARRCKPT_SKIP_INTEROP=1` turns a missing Python into a loud SKIPPED line).

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{cut, piece, tensor_bytes};
use zarrckpt::model::convert::convert;
use zarrckpt::{
    Cast, Communicator, Compression, DType, Error, GridOptions, LoadOptions, LoadTarget, LocalComm,
    Region, SaveOptions, ShardedTensor, TensorKey, load, run_local, save,
};

const TYPES: [DType; 4] = [
    DType::Float16,
    DType::BFloat16,
    DType::Float32,
    DType::Float64,
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> Option<PathBuf> {
    let p = match std::env::var_os("ZARRCKPT_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo().join(".venv/bin/python"),
    };
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("ZARRCKPT_SKIP_INTEROP").is_ok_and(|v| v == "1") {
        let _ = writeln!(
            std::io::stderr(),
            "\n!!!!!!!! SKIPPED conversion reference test (ZARRCKPT_SKIP_INTEROP=1): no Python at {}\n",
            p.display()
        );
        return None;
    }
    panic!(
        "no Python with numpy and ml_dtypes at {} (set ZARRCKPT_PYTHON, run scripts/setup-venv.sh, \
         or set ZARRCKPT_SKIP_INTEROP=1 to skip)",
        p.display()
    );
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Float32 inputs (bits).
fn inputs_f32() -> Vec<u64> {
    let mut v: Vec<u32> = vec![
        0,
        0x8000_0000,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0xFFC0_0000,
        0x7F80_0001,
        0x7FA0_0000,
        0x7FFF_FFFF,
        0xFFBF_FFFF,
        0x7FC0_2000,
        0x7FC0_1FFF,
        1,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F7F_8000,
        0x7F7F_7FFF,
    ];
    // f16 limits: max 65504, the tie to infinity 65520, subnormal range and its tie 2^-25.
    for f in [
        65504.0f32,
        65519.996,
        65520.0,
        65536.0,
        6.1035156e-5,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        1.0,
        -1.0,
    ] {
        let b = f.to_bits();
        v.extend([b, b - 1, b + 1, b | 0x8000_0000]);
    }
    let mut r = Rng(0x1234_5678_9ABC_DEF1);
    for _ in 0..60_000 {
        let x = r.next() as u32;
        v.push(x);
        // Ties and neighbours for bfloat16 (16 dropped bits) and float16 normals (13).
        v.push((x & !0xFFFF) | 0x8000);
        v.push((x & !0xFFFF) | 0x7FFF);
        v.push((x & !0xFFFF) | 0x8001);
        let e = (0x3800_0000 + ((x >> 9) % 0x0F00_0000)) & 0x7F80_0000; // exponents near f16's
        let base = (x & 0x8000_0000) | e | (x & 0x007F_E000);
        v.extend([base | 0x1000, base | 0x0FFF, base | 0x1001]);
        // Ties in the f16 subnormal range: 2^-25 .. 2^-14, random dropped-bit patterns.
        let sub = (x & 0x8000_0000) | ((0x66 + (x >> 8) % 12) << 23) | (x & 0x007F_FFFF);
        v.push(sub);
    }
    v.into_iter().map(u64::from).collect()
}

/// Float64 inputs (bits).
fn inputs_f64() -> Vec<u64> {
    let mut v: Vec<u64> = vec![
        0,
        1 << 63,
        0x7FF0 << 48,
        0xFFF0 << 48,
        0x7FF8 << 48,
        0xFFF8 << 48,
        0x7FF0_0000_0000_0001,
        0x7FF4_0000_0000_0000,
        0x7FF8_0000_2000_0000,
        0x7FFF_FFFF_FFFF_FFFF,
        0x7FF8_0000_0000_0001,
        1,
        0x000F_FFFF_FFFF_FFFF,
        0x7FEF_FFFF_FFFF_FFFF,
    ];
    for f in [
        f64::from(f32::MAX),
        f64::from(f32::MIN_POSITIVE),
        2f64.powi(-149),
        2f64.powi(-150),
        2f64.powi(-133),
        2f64.powi(-134),
        65504.0,
        65520.0,
        2f64.powi(-24),
        2f64.powi(-25),
        (2.0 - 2f64.powi(-7)) * 2f64.powi(127), // bf16 max
        (2.0 - 2f64.powi(-8)) * 2f64.powi(127), // bf16 max + half ulp: the tie to infinity
    ] {
        let b = f.to_bits();
        v.extend([b, b - 1, b + 1, b | (1 << 63)]);
    }
    let mut r = Rng(0x0FED_CBA9_8765_4321);
    for _ in 0..60_000 {
        let x = r.next();
        v.push(x);
        // A value in a useful exponent range (f32 subnormals to beyond f32 max).
        let e = (1023 - 160 + (x >> 11) % 300) << 52;
        let base = (x & (1 << 63)) | e | (x & 0x000F_FFFF_FFFF_FFFF);
        v.push(base);
        // Ties (and neighbours) for float32 (29 dropped bits), bfloat16 (45), float16 (42).
        for drop in [29u32, 45, 42] {
            let t = (base & !((1u64 << drop) - 1)) | (1 << (drop - 1));
            v.extend([t, t - 1, t + 1]);
            // Within half a float32 ulp of a bfloat16 tie: where rounding twice goes wrong.
            if drop == 45 {
                v.extend([t + (1 << 20), t - (1 << 20)]);
            }
        }
    }
    v
}

/// Every pattern of a 16-bit type.
fn inputs_16() -> Vec<u64> {
    (0..=u64::from(u16::MAX)).collect()
}

fn pack(bits: &[u64], size: usize) -> Vec<u8> {
    bits.iter()
        .flat_map(|b| b.to_le_bytes()[..size].to_vec())
        .collect()
}

fn unpack(bytes: &[u8], size: usize) -> Vec<u64> {
    bytes
        .chunks_exact(size)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..size].copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

fn is_nan(bits: u64, d: DType) -> bool {
    match d {
        DType::Float16 => bits & 0x7FFF > 0x7C00,
        DType::BFloat16 => bits & 0x7FFF > 0x7F80,
        DType::Float32 => bits & 0x7FFF_FFFF > 0x7F80_0000,
        _ => bits & !(1 << 63) > 0x7FF0 << 48,
    }
}

fn sign(bits: u64, d: DType) -> u64 {
    bits >> (8 * d.size() - 1)
}

#[test]
fn conversions_match_numpy_and_ml_dtypes_bit_for_bit() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let inputs = |d: DType| match d {
        DType::Float32 => inputs_f32(),
        DType::Float64 => inputs_f64(),
        _ => inputs_16(),
    };
    for d in TYPES {
        std::fs::write(
            dir.path().join(format!("in_{d}.bin")),
            pack(&inputs(d), d.size()),
        )
        .unwrap();
    }
    let out = Command::new(&py)
        .arg(repo().join("tests/python/convert_ref.py"))
        .arg(dir.path())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "convert_ref.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let read =
        |name: String, size: usize| unpack(&std::fs::read(dir.path().join(name)).unwrap(), size);
    let mut summary = String::new();
    for s in TYPES {
        let input = inputs(s);
        let src = pack(&input, s.size());
        for d in TYPES {
            if s == d {
                continue;
            }
            let mut dst = vec![0u8; input.len() * d.size()];
            convert(s, &src, d, &mut dst).unwrap();
            let ours = unpack(&dst, d.size());
            let lib = read(format!("lib_{s}_{d}.bin"), d.size());
            let rule = read(format!("rule_{s}_{d}.bin"), d.size());
            let exact_ref = (s == DType::Float64 && d == DType::BFloat16)
                .then(|| read("rto_float64_bfloat16.bin".into(), 2));
            let (mut nans, mut lib_diffs) = (0usize, 0usize);
            for i in 0..input.len() {
                let x = input[i];
                if is_nan(x, s) {
                    nans += 1;
                    assert_eq!(
                        ours[i], rule[i],
                        "{s} -> {d}: NaN {x:#x} gives {:#x}, the NaN rule says {:#x}",
                        ours[i], rule[i]
                    );
                    assert!(is_nan(lib[i], d), "{s} -> {d}: library lost NaN {x:#x}");
                    assert_eq!(
                        sign(ours[i], d),
                        sign(lib[i], d),
                        "{s} -> {d}: NaN sign {x:#x}"
                    );
                    let canonical = match s {
                        DType::Float16 => 0x7E00,
                        DType::BFloat16 => 0x7FC0,
                        DType::Float32 => 0x7FC0_0000,
                        _ => 0x7FF8 << 48,
                    };
                    if x & !(1 << (8 * s.size() - 1)) == canonical {
                        assert_eq!(ours[i], lib[i], "{s} -> {d}: quiet NaN {x:#x}");
                    }
                    continue;
                }
                let expect = exact_ref.as_ref().map_or(lib[i], |r| r[i]);
                assert_eq!(
                    ours[i], expect,
                    "{s} -> {d}: input {x:#x} gives {:#x}, reference {expect:#x} (library {:#x})",
                    ours[i], lib[i]
                );
                if ours[i] != lib[i] {
                    lib_diffs += 1;
                }
            }
            if exact_ref.is_some() {
                // The inputs include values where rounding twice goes wrong: the test sees
                // the difference, and ours is the correctly rounded one.
                assert!(lib_diffs > 0, "no double-rounding case exercised");
            } else {
                assert_eq!(lib_diffs, 0);
            }
            summary += &format!(
                "{s} -> {d}: {} inputs ({nans} NaN) bit-exact{}\n",
                input.len(),
                if lib_diffs > 0 {
                    format!(" (ml_dtypes' double rounding differs on {lib_diffs})")
                } else {
                    String::new()
                }
            );
        }
    }
    eprint!("{summary}");
}

// ---------------------------------------------------------------------------------------------
// Real loads
// ---------------------------------------------------------------------------------------------

const T: Duration = Duration::from_secs(60);

/// A float32 tensor's bytes: random bit patterns (NaNs, infinities and subnormals included)
/// with every fourth element a value of moderate size, so that most rounding is exercised.
fn f32_data(seed: u64, shape: &[u64]) -> Vec<u8> {
    let mut b = tensor_bytes(seed, shape, DType::Float32);
    for (i, v) in b.chunks_exact_mut(4).enumerate() {
        if i % 4 != 0 {
            let x = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
            let moderate = (x & 0x807F_FFFF) | ((0x70 + (x >> 24) % 32) << 23);
            v.copy_from_slice(&moderate.to_le_bytes());
        }
    }
    b
}

/// Saves float32 `key` of `shape` by `ranks` in-process ranks, split by rows.
fn save_f32(dir: &Path, key: &str, shape: &[u64], data: &[u8], ranks: u64, opts: &SaveOptions) {
    for r in run_local(ranks as usize, T, |comm| {
        let region = piece(shape, 0, ranks, comm.rank() as u64);
        let bytes = cut(data, shape, &region, 4);
        let p = ShardedTensor::new(
            TensorKey::new(key).unwrap(),
            DType::Float32,
            shape.to_vec(),
            region,
            0,
            &bytes,
        )
        .unwrap();
        save(&[p], dir, &comm, opts).map(|_| ())
    }) {
        r.unwrap();
    }
}

/// `region` of the tensor converted to `to`, as the loads must give it.
fn expected(data: &[u8], shape: &[u64], region: &Region, to: DType) -> Vec<u8> {
    let part = cut(data, shape, region, 4);
    let mut out = vec![0u8; part.len() / 4 * to.size()];
    convert(DType::Float32, &part, to, &mut out).unwrap();
    out
}

fn target<'a>(
    key: &str,
    to: DType,
    shape: &[u64],
    region: &Region,
    buf: &'a mut [u8],
) -> LoadTarget<'a> {
    LoadTarget::new(
        TensorKey::new(key).unwrap(),
        to,
        shape.to_vec(),
        region.clone(),
        buf,
    )
    .unwrap()
}

#[test]
fn float32_checkpoint_loads_into_bf16_f16_f64_resharded_and_by_boxes() {
    let shape = [45u64, 33];
    let data = f32_data(7, &shape);
    let tmp = tempfile::tempdir().unwrap();
    // Small subchunks (many per shard, staged and converted tile by tile); uncompressed and zstd.
    for (name, compression) in [("raw", Compression::None), ("zstd", Compression::Zstd)] {
        let dir = tmp.path().join(name);
        let opts = SaveOptions {
            compression,
            grid: GridOptions {
                subchunk_target_bytes: 256,
                ..GridOptions::default()
            },
            ..SaveOptions::default()
        };
        save_f32(&dir, "w", &shape, &data, 4, &opts);
        // 3 ranks, split by columns, each with: its column block in bfloat16 (converted), the
        // same block in float32 (exact, shared with nobody) and an unaligned box in float16
        // and float64; ranks 0 and 1 also both ask for rows 10..30 in float32 and in
        // bfloat16 (the exact ones are read once and exchanged; the converted ones alone).
        let results = run_local(3, T, |comm| {
            let r = comm.rank() as u64;
            let cols = piece(&shape, 1, 3, r);
            let unaligned = Region::new(vec![3 + r, 5], vec![29, 17 + r]).unwrap();
            let shared = Region::new(vec![10, 0], vec![20, 33]).unwrap();
            let cases: Vec<(Region, DType)> = [
                (cols.clone(), DType::BFloat16),
                (cols.clone(), DType::Float32),
                (unaligned.clone(), DType::Float16),
                (unaligned, DType::Float64),
            ]
            .into_iter()
            .chain(
                (r < 2)
                    .then(|| [(shared.clone(), DType::Float32), (shared, DType::BFloat16)])
                    .into_iter()
                    .flatten(),
            )
            .collect();
            let mut bufs: Vec<Vec<u8>> = cases
                .iter()
                .map(|(reg, d)| vec![0u8; reg.num_elements().unwrap() as usize * d.size()])
                .collect();
            let report = {
                let mut targets: Vec<LoadTarget> = cases
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|((reg, d), b)| {
                        target("w", *d, &shape, reg, b).with_cast(Cast::FloatConvert)
                    })
                    .collect();
                load(&mut targets, &dir, &comm, &LoadOptions::default())
            };
            (cases, bufs, report)
        });
        for (rank, (cases, bufs, report)) in results.into_iter().enumerate() {
            let report = report.unwrap_or_else(|e| panic!("{name} rank {rank}: {e}"));
            for ((region, to), got) in cases.iter().zip(&bufs) {
                assert!(
                    *got == expected(&data, &shape, region, *to),
                    "{name} rank {rank}: {region} as {to}"
                );
            }
            if rank < 2 {
                assert!(
                    report.bytes_received + report.bytes_sent > 0,
                    "{name} rank {rank}: the exact shared box is still exchanged"
                );
            }
        }
    }
}

#[test]
fn conversion_over_several_staging_tiles_and_mismatches_without_it() {
    // One 6 MiB shard: more than one staging tile.
    let shape = [1536u64, 1024];
    let data = f32_data(11, &shape);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("big");
    save_f32(&dir, "big", &shape, &data, 1, &SaveOptions::default());
    let full = Region::full(&shape);
    let mut buf = vec![0u8; 1536 * 1024 * 2];
    let mut t =
        [target("big", DType::BFloat16, &shape, &full, &mut buf).with_cast(Cast::FloatConvert)];
    load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap();
    assert!(buf == expected(&data, &shape, &full, DType::BFloat16));

    // Never a silent cast: without `Cast::FloatConvert` it is a mismatch.
    let mut small = vec![0u8; 2];
    let one = Region::new(vec![0, 0], vec![1, 1]).unwrap();
    let mut t = [target("big", DType::BFloat16, &shape, &one, &mut small)];
    let e = load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DtypeMismatch {
                requested: DType::BFloat16,
                stored: DType::Float32,
                ..
            }
        ),
        "{e:?}"
    );
    // Nor between types the conversion does not cover.
    let mut ints = vec![0u8; 4];
    let mut t =
        [target("big", DType::Int32, &shape, &one, &mut ints).with_cast(Cast::FloatConvert)];
    let e = load(&mut t, &dir, &LocalComm::single(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DtypeMismatch {
                requested: DType::Int32,
                stored: DType::Float32,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(ints, vec![0; 4]);
}
