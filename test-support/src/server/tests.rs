use super::*;

#[test]
fn an_unset_or_empty_valkey_variable_is_an_error_with_the_hint() {
    for value in [None, Some(OsString::new())] {
        let why = valkey_server_from(value).expect_err("no path, no server");
        assert!(why.contains("TRL_VALKEY_SERVER is not set"), "{why}");
        assert!(why.contains("scripts/valkey.sh"), "{why}");
    }
}

#[test]
fn a_valkey_variable_naming_no_file_is_an_error_with_the_hint() {
    let missing = std::env::temp_dir().join("trl-no-such-dir/valkey-server");
    let why = valkey_server_from(Some(missing.clone().into_os_string())).expect_err("no file");
    assert!(why.contains(&format!("={}", missing.display())), "{why}");
    assert!(why.contains("scripts/valkey.sh"), "{why}");
}

#[test]
fn a_valkey_variable_naming_a_file_is_its_path() {
    let file = std::env::current_exe().expect("the test binary's path");
    assert_eq!(
        valkey_server_from(Some(file.clone().into_os_string())),
        Ok(file)
    );
}
