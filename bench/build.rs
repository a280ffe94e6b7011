//! Compiles the `fido bench rpc` baselines' schemas: the protobuf service for tonic
//! (needs `protoc`, Debian package protobuf-compiler) and the Cap'n Proto schema for
//! capnp-rpc (needs `capnp`, Debian package capnproto).

fn main() {
    println!("cargo:rerun-if-changed=proto/bench.proto");
    println!("cargo:rerun-if-changed=proto/bench.capnp");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // ByteSeq travels as `bytes::Bytes` (no copy into a Vec on decode): ANCHORS fairness.
        .bytes(".")
        .compile_protos(&["proto/bench.proto"], &["proto"])
        .expect("compiling proto/bench.proto (is protoc installed? Debian: protobuf-compiler)");
    capnpc::CompilerCommand::new()
        .src_prefix("proto")
        .file("proto/bench.capnp")
        // The generated code lives in `crate::rpc::bench_capnp`.
        .default_parent_module(vec!["rpc".into()])
        .run()
        .expect("compiling proto/bench.capnp (is capnp installed? Debian: capnproto)");
}
