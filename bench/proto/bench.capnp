# The `fido bench rpc` service for the capnp-rpc baseline (same calls as
# bench.proto): a null call and the VMRPC paper's Table 2 sequences.
@0xa3ebd36589848e37;

struct Fixed { i @0 :Int32; j @1 :Int32; d @2 :Float64; }
struct Var { s @0 :Text; d @1 :Float64; }

interface Bench {
  null @0 () -> ();
  sendBytes @1 (data :Data) -> (sum :UInt64);
  sendFixed @2 (seq :List(Fixed)) -> (sum :UInt64);
  sendVar @3 (seq :List(Var)) -> (sum :UInt64);
  recvBytes @4 (len :UInt64, seed :UInt64) -> (data :Data, sum :UInt64);
  recvFixed @5 (len :UInt64, seed :UInt64) -> (seq :List(Fixed), sum :UInt64);
  recvVar @6 (len :UInt64, seed :UInt64) -> (seq :List(Var), sum :UInt64);
}
