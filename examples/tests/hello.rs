//! Runs the `hello` example end to end (its own embedded broker, a server
//! child process) and checks what it prints.

use std::process::Command;

#[test]
fn hello_round_trip_and_watch() {
    let out = Command::new(env!("CARGO_BIN_EXE_hello"))
        .env_remove("FIDO_BROKER") // always the embedded broker
        .output()
        .expect("run the hello example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "hello failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for expected in [
        "client sent: world",
        "client received: hello, world! (tag 1, from domain ",
        "watch: /app/hello/greeted = \"world\"",
        "payload bytes copied by the client: 0",
        "server received: world",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
}
