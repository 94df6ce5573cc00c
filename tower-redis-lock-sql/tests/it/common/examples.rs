//! The example binaries the process-level tests spawn, built from the
//! test with the outer `cargo test`'s features and environment, so that
//! nothing is compiled again, inside the test run or after it.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/examples/<name>` of this crate, built first with the
/// features this test was built with (so the library build is shared; a
/// no-op when fresh).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/it-<hash>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let target_dir = profile_dir.parent().expect("target/<profile>");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => "dev",
    };
    let mut features = vec!["postgres"];
    if cfg!(feature = "sqlx-postgres") {
        features.push("sqlx-postgres");
    }
    if cfg!(feature = "sqlx-sqlite") {
        features.push("sqlx-sqlite");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(&cargo);
    // Without the variables cargo sets for a test process: build scripts
    // that watch them would otherwise run again, and everything above them
    // rebuild, each time the environment differs from the outer `cargo
    // test`'s.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref())
        {
            build.env_remove(name.as_ref());
        }
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "--quiet", "-p", env!("CARGO_PKG_NAME")])
        .args(["--example", name, "--profile", profile])
        .args(["--features", &features.join(",")])
        .arg("--target-dir")
        .arg(target_dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cargo}: {e}"));
    assert!(
        status.success(),
        "`cargo build -p {} --example {name}` failed ({status})",
        env!("CARGO_PKG_NAME")
    );
    let bin = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} missing after the build", bin.display());
    bin
}
