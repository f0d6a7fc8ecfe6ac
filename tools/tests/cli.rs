//! The `flashgen` command line, end to end, without a GPU: emit, NVRTC
//! check, readable spec errors, precompile into a cache and inspect it
//! (kernels and tuning records).
//! (`run` needs a GPU; here it must fail with a typed message, not a panic.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn flashgen(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashgen"))
        .args(args)
        .env("FLASHGEN_CACHE_DIR", cache)
        .output()
        .expect("the flashgen binary runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn spec(name: &str) -> String {
    format!("{}/../specs/{name}.attn", env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn emit_prints_the_kernel() {
    let out = flashgen(&["emit", &spec("sliding_window")], &scratch("emit"));
    assert!(out.status.success(), "{}", text(&out));
    let source = String::from_utf8_lossy(&out.stdout);
    assert!(source.contains("extern \"C\" __global__ void __launch_bounds__(CTA_THREADS) flashgen_fwd_sliding_window("));
    assert!(source.contains("int p_window"), "params become kernel arguments");
}

#[test]
fn emit_takes_a_named_tile_config() {
    let dir = scratch("emit-config");
    let emit = |config: &str| flashgen(&["emit", &spec("causal"), "--arch", "sm_90", "--config", config], &dir);
    let out = emit("wgmma.w8.m1.n64");
    assert!(out.status.success(), "{}", text(&out));
    let source = String::from_utf8_lossy(&out.stdout);
    assert!(source.contains("constexpr int WARPS = 8;") && source.contains("constexpr int BLOCK_N = 64;"), "{source}");

    let out = emit("wgmma.w5.m1.n64");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let message = text(&out);
    assert!(message.contains("no tile configuration `wgmma.w5.m1.n64` on sm_90"), "{message}");
    assert!(message.contains("its candidates: wgmma.w8.m1.n128"), "{message}");
}

#[test]
fn emit_prints_varlen_kernels() {
    let dir = scratch("emit-varlen");
    for arch in [&["--arch", "sm_80"][..], &["--arch", "sm_90", "--config", "wgmma.w8.m1.n128"]] {
        let out = flashgen(&[&["emit", &spec("document"), "--varlen"], arch].concat(), &dir);
        assert!(out.status.success(), "{}", text(&out));
        let source = String::from_utf8_lossy(&out.stdout);
        assert!(
            source.contains("flashgen_fwd_varlen_document(") && source.contains("seq_span(cu_seqlens_q"),
            "{source}"
        );
    }
    let out = flashgen(&["emit", &spec("causal"), "--varlen", "--trace", "--arch", "sm_90", "--config", "x"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn emit_prints_backward_kernels() {
    let dir = scratch("emit-backward");
    let emit = |args: &[&str]| flashgen(&[&["emit", &spec("causal"), "--backward"], args].concat(), &dir);
    for (args, kernel) in [
        (&["key-value", "--arch", "sm_90"][..], "flashgen_bwd_causal("),
        (&["query"], "flashgen_bwd_dq_causal("),
        (&["key-value", "--varlen"], "flashgen_bwd_varlen_causal("),
    ] {
        let out = emit(args);
        assert!(out.status.success(), "{}", text(&out));
        let source = String::from_utf8_lossy(&out.stdout);
        assert!(source.contains(kernel), "{kernel} not in {source}");
    }
    let out = emit(&["key-value", "--arch", "sm_90", "--config", "wgmma.w8.m1.n128"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn emit_traces_warp_specialized_configs_only() {
    let dir = scratch("emit-trace");
    let emit =
        |config: &str| flashgen(&["emit", &spec("causal"), "--trace", "--arch", "sm_90", "--config", config], &dir);
    let out = emit("wgmma.w8.m1.n128");
    assert!(out.status.success(), "{}", text(&out));
    let source = String::from_utf8_lossy(&out.stdout);
    assert!(source.contains("TRACE_COUNTER\n") && source.contains("TR(20);"), "{source}");

    let out = emit("wgmma.w8.m1.n64");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--trace needs a warp-specialized --config"), "{}", text(&out));
    let out = flashgen(&["emit", &spec("causal"), "--trace"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn spec_errors_name_file_line_and_column() {
    let dir = scratch("errors");
    let bad = dir.join("bad.attn");
    std::fs::write(&bad, "Bad {\n    dtype: bf16, head_dim: 64,\n    mask: q - k,\n}\n").unwrap();
    let out = flashgen(&["emit", bad.to_str().unwrap()], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let message = text(&out);
    assert!(message.contains("bad.attn:3:11: error: the mask must be bool, found i32"), "{message}");
    assert!(message.contains("   3 |     mask: q - k,"), "{message}");
    assert_eq!(message.matches("error:").count(), 1, "one `error:` label: {message}");

    std::fs::write(&bad, "Open {\n    dtype: bf16, head_dim: 64,\n").unwrap();
    let message = text(&flashgen(&["check", bad.to_str().unwrap()], &dir));
    assert!(message.contains("bad.attn:1:6: error: unclosed `{` opened at 1:6"), "{message}");
    assert_eq!(message.matches("error:").count(), 1, "one `error:` label: {message}");
}

#[test]
fn unknown_spec_names_list_the_files_specs() {
    let dir = scratch("spec-name");
    let out = flashgen(&["emit", &spec("causal"), "--spec", "Nope"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("has no spec named `Nope`; its specs: `Causal`"), "{}", text(&out));
}

#[test]
fn unsupported_arches_are_refused_before_nvrtc() {
    let dir = scratch("arch");
    let out = flashgen(&["check", &spec("causal"), "--arch", "sm_70"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let message = text(&out);
    assert!(message.starts_with("error: sm_70 is not supported: flashgen kernels need sm_80 or newer"), "{message}");
    assert!(message.contains("sm_86") && message.contains("sm_90"), "lists the supported arches: {message}");
    assert_eq!(message.lines().count(), 1, "no kernel source: {message}");
    let out = flashgen(&["emit", &spec("causal"), "--arch", "sm_75"], &dir);
    assert!(text(&out).contains("sm_75 is not supported"), "{}", text(&out));
    // An arch NVRTC does not know is NVRTC's to refuse, in one line too.
    let out = flashgen(&["check", &spec("causal"), "--arch", "sm_99"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("this NVRTC cannot compile for sm_99"), "{}", text(&out));
    assert_eq!(text(&out).lines().count(), 1, "no kernel source: {}", text(&out));
    let out = flashgen(&["precompile", &spec("causal"), "--arch", "sm_99"], &dir);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("this NVRTC cannot compile for sm_99"), "{}", text(&out));
    assert_eq!(text(&out).lines().count(), 1, "no kernel source: {}", text(&out));
}

#[test]
fn check_and_precompile_use_nvrtc_and_fill_the_cache() {
    let cache = scratch("cache");
    let out = flashgen(&["check", &spec("alibi"), "--arch", "sm_80"], &cache);
    assert!(out.status.success(), "needs NVRTC (scripts/test.sh installs it): {}", text(&out));
    assert!(text(&out).contains("Alibi: compiled flashgen_fwd_alibi for sm_80"), "{}", text(&out));

    let out = flashgen(&["precompile", &spec("document"), "--arch", "sm_90"], &cache);
    assert!(out.status.success(), "{}", text(&out));
    let out = flashgen(&["cache", "stats"], &cache);
    assert!(out.status.success(), "{}", text(&out));
    // The document spec has a forward, a block-mask kernel and the
    // persistent forward's work order.
    assert_eq!(cubins(&cache), 3, "{}", text(&out));
    let out = flashgen(&["cache", "clear"], &cache);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(cubins(&cache), 0);
}

#[test]
fn check_all_compiles_every_kernel_a_launch_may_use() {
    let dir = scratch("check-all");
    let out = flashgen(&["check", &spec("causal"), "--arch", "sm_80", "--all"], &dir);
    assert!(out.status.success(), "{}", text(&out));
    let report = text(&out);
    let count = report.split("compiled ").nth(1).and_then(|rest| rest.split(' ').next());
    let count: usize = count.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("a kernel count: {report}"));
    // Causal at d = 128 on sm_80: two forward configurations, dense, varlen
    // and paged, the paged append, the block-mask kernel, the four backward
    // kernels dense and varlen, the decode kernels (one and two row tiles,
    // dense and paged caches, padded and packed queries; splits combine in
    // the kernel), dropout's forward (the preferred configuration) and its
    // dK/dV and dQ kernels, and context parallelism's merge, add and flat add.
    assert_eq!(count, 30, "{report}");
    assert!(report.contains(" kernels for sm_80 with NVRTC"), "{report}");
}

#[test]
fn precompiles_started_together_compile_each_kernel_once() {
    let cache = scratch("cache-shared");
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_flashgen"))
            .args(["precompile", &spec("document"), "--arch", "sm_90"])
            .env("FLASHGEN_CACHE_DIR", &cache)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the flashgen binary runs")
    };
    let ranks: Vec<_> = (0..4).map(|_| spawn()).collect();
    let compiled: usize = ranks
        .into_iter()
        .map(|rank| {
            let out = rank.wait_with_output().unwrap();
            assert!(out.status.success(), "{}", text(&out));
            let report = String::from_utf8_lossy(&out.stdout).into_owned();
            let count = report.split(": ").nth(1).and_then(|rest| rest.split(' ').next());
            count.and_then(|n| n.parse::<usize>().ok()).unwrap_or_else(|| panic!("a report: {report}"))
        })
        .sum();
    assert_eq!(compiled, 3, "the document spec's three kernels, each compiled by one process");
    assert_eq!(cubins(&cache), 3);
}

#[test]
fn check_warns_of_indices_that_may_leave_their_dimension() {
    let dir = scratch("index-warnings");
    let out = flashgen(&["check", &spec("document"), "--arch", "sm_80"], &dir);
    assert!(out.status.success(), "a warning is no failure: {}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().next(),
        Some(
            "warning: Document: `doc[b][q]`: index 2 `q` can reach 1023, past dimension `KV_LEN` = 512, at B = 1, \
             H = 1, H_KV = 1, Q_LEN = 1024, KV_LEN = 512; out-of-range indices read the nearest element"
        ),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "`doc[b][k]` stays inside: {stderr}");
    let out = flashgen(&["check", &spec("relative_bias"), "--arch", "sm_80"], &dir);
    assert!(out.status.success() && out.stderr.is_empty(), "a clamped offset warns of nothing: {}", text(&out));
}

/// How many compiled kernels the cache folder `dir` holds.
fn cubins(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "cubin"))
        .count()
}

#[test]
fn run_reports_bad_arguments_and_missing_gpus_as_errors() {
    let dir = scratch("run");
    let out = flashgen(&["run", &spec("sliding_window"), "--seq", "128"], &dir);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("missing --param window=<i32>"), "{}", text(&out));
    // Arguments are checked before the GPU is looked for.
    for (args, expected) in [
        (["--heads", "16/5", "--seq", "64"], "--heads 16/5: 16 query heads cannot share 5 K/V heads"),
        (["--heads", "8", "--seq", "0"], "--seq 0: sizes must be at least 1"),
        (["--heads", "0/0", "--seq", "64"], "--heads 0/0: sizes must be at least 1"),
        (["--heads", "8", "--seq", "1k"], "--seq 1k: expected N or N/M"),
        (["--heads", "8", "--seq", "99999999999"], "--batch 1 --seq 99999999999 --heads 8: an operand of head dim"),
    ] {
        let out = flashgen(&[&["run", &spec("causal")][..], &args].concat(), &dir);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).starts_with(&format!("error: {expected}")), "{}", text(&out));
    }
    // So are input files: Q of [1, 4, 2, 128] is 1024 values.
    let q = dir.join("q.bin");
    std::fs::write(&q, vec![0u8; 4 * 1000]).unwrap();
    let q = q.to_str().unwrap();
    let out = flashgen(&["run", &spec("causal"), "--seq", "4", "--heads", "2", "--q", q], &dir);
    assert!(
        text(&out).starts_with(&format!("error: {q}: holds 1000 elements, the shape needs 1024")),
        "{}",
        text(&out)
    );
    let out = flashgen(&["run", &spec("causal"), "--d-out", q], &dir);
    assert!(text(&out).contains("--backward"), "dO needs --backward: {}", text(&out));
}

#[test]
fn cache_commands_count_list_and_clear_tuning_records() {
    let cache = scratch("tuning");
    std::fs::create_dir_all(cache.join("tuning")).unwrap();
    std::fs::write(cache.join("tuning").join("0123abcd.txt"), "flashgen-tuning 1\nend\n").unwrap();
    let out = flashgen(&["cache", "stats"], &cache);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("entries: 0\n"), "{}", text(&out));
    assert!(text(&out).contains("tuning:  1 records"), "{}", text(&out));
    let out = flashgen(&["cache", "list"], &cache);
    assert!(text(&out).contains("tuning/0123abcd.txt"), "{}", text(&out));
    let out = flashgen(&["cache", "clear"], &cache);
    assert!(text(&out).contains("removed 0 kernels and 1 tuning records"), "{}", text(&out));
    assert!(!cache.join("tuning").join("0123abcd.txt").exists());
}
