//! CPU-side tests of the CUDA backend: presence probing, `cuInit` classification and size
//! rounding. The paths that need a GPU run in `src/bin/gpu_check/` (scripts/gpu-check.sh).

use super::*;

#[test]
fn a_missing_library_is_not_present_with_the_loader_reason() {
    let e = probe_library(&["libfabric-no-such-cuda.so.1"]).unwrap_err();
    assert!(e.contains("libfabric-no-such-cuda.so.1"), "{e}");
    let r = classify_init(Err(e), || panic!("cuInit must not be reached without the library"));
    let msg = r.unwrap_err().to_string();
    assert!(msg.starts_with("CUDA not present: "), "{msg}");
}

#[test]
fn init_failures_that_mean_no_driver_are_not_present() {
    let call = |raw: u32, code: &str| CudaError::Call { op: "cuInit", code: code.into(), raw };
    let no_dev = classify_init(Ok(()), || Err(call(CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"))).unwrap_err();
    assert_eq!(no_dev, CudaError::NotPresent("cuInit: CUDA_ERROR_NO_DEVICE".into()));
    let stub = classify_init(Ok(()), || Err(call(CUDA_ERROR_STUB_LIBRARY, "CUDA_ERROR_STUB_LIBRARY"))).unwrap_err();
    assert!(matches!(stub, CudaError::NotPresent(_)));
    let panicked =
        classify_init(Ok(()), || Err(CudaError::Panicked { op: "cuInit", message: "Missing symbol".into() }));
    assert!(matches!(panicked, Err(CudaError::NotPresent(m)) if m.contains("Missing symbol")));
    // Other failures stay failures: a driver that is there but broken is not "absent".
    let other = classify_init(Ok(()), || Err(call(999, "CUDA_ERROR_UNKNOWN"))).unwrap_err();
    assert!(matches!(other, CudaError::Call { raw: 999, .. }));
    assert_eq!(classify_init(Ok(()), || Ok(())), Ok(()));
}

#[test]
fn without_a_driver_every_entry_point_says_not_present() {
    // On a machine with a working driver this test has nothing to show.
    if probe_library(&[LIBCUDA]).is_ok() {
        return;
    }
    for e in [available().unwrap_err(), device_count().unwrap_err(), CudaContext::new(0).unwrap_err()] {
        assert!(matches!(&e, CudaError::NotPresent(r) if r.contains("libcuda.so.1")), "{e}");
        assert!(e.to_string().starts_with("CUDA not present: "));
    }
}

#[test]
fn sizes_round_up_to_the_granularity() {
    const MIB2: usize = 2 << 20;
    assert_eq!(round_up(1, MIB2), Ok(MIB2));
    assert_eq!(round_up(MIB2, MIB2), Ok(MIB2));
    assert_eq!(round_up(MIB2 + 1, MIB2), Ok(2 * MIB2));
    assert_eq!(round_up(100, 3), Ok(102));
    assert!(round_up(0, MIB2).is_err());
    assert!(round_up(1, 0).is_err());
    assert!(round_up(usize::MAX, MIB2).is_err());
}

#[test]
fn unsupported_is_recognised() {
    let e =
        CudaError::Call { op: "cuMemCreate", code: "CUDA_ERROR_NOT_SUPPORTED".into(), raw: CUDA_ERROR_NOT_SUPPORTED };
    assert!(e.is_unsupported());
    assert!(!CudaError::NotPresent("x".into()).is_unsupported());
}
