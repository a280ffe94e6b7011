#!/bin/sh
# Regenerates the checked-in Rust code of the `fido-bench rpc` baselines' schemas:
#
#   bench/proto/bench.proto  -> bench/src/rpc/generated/fidobench.rs   (prost messages + tonic service)
#   bench/proto/bench.capnp  -> bench/src/rpc/generated/bench_capnp.rs (Cap'n Proto, module crate::rpc::bench_capnp)
#
# The build never runs this: the generated files are committed, so `cargo build
# --workspace` needs no `protoc` and no `capnp`. Run it after editing a schema; it
# needs `protoc` (Debian: protobuf-compiler) and `capnp` (Debian: capnproto) on PATH,
# and builds a throw-away program with tonic-prost-build and capnpc (the versions
# below match bench/Cargo.toml's tonic/prost and capnp). Set CARGO_TARGET_DIR to
# reuse a build directory.
#
#   sh bench/proto/regenerate.sh
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out="$here/../src/rpc/generated"
for tool in protoc capnp; do
    command -v "$tool" >/dev/null 2>&1 || {
        echo "regenerate.sh: $tool is not on PATH (Debian: protobuf-compiler, capnproto)" >&2
        exit 1
    }
done
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src"
cat >"$tmp/Cargo.toml" <<'TOML'
[package]
name = "fido-bench-regenerate"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
tonic-prost-build = "=0.14.9"
capnpc = "=0.27.0"

# Not a member of the Fido workspace.
[workspace]
TOML
cat >"$tmp/src/main.rs" <<'RUST'
fn main() {
    let mut args = std::env::args().skip(1);
    let proto = std::path::PathBuf::from(args.next().expect("proto dir"));
    let out = std::path::PathBuf::from(args.next().expect("out dir"));
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // ByteSeq travels as `bytes::Bytes` (no copy into a Vec on decode): ANCHORS fairness.
        .bytes(".")
        .out_dir(&out)
        .compile_protos(&[proto.join("bench.proto")], &[proto.clone()])
        .expect("compiling bench.proto (is protoc installed? Debian: protobuf-compiler)");
    capnpc::CompilerCommand::new()
        .src_prefix(&proto)
        .file(proto.join("bench.capnp"))
        // The generated code lives in `crate::rpc::bench_capnp`.
        .default_parent_module(vec!["rpc".into()])
        .output_path(&out)
        .run()
        .expect("compiling bench.capnp (is capnp installed? Debian: capnproto)");
}
RUST
cargo run --quiet --release --manifest-path "$tmp/Cargo.toml" -- "$here" "$out"
echo "regenerated $out/fidobench.rs and $out/bench_capnp.rs"
