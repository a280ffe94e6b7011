//! VMRPC C ABI (`include/fido/rpc.h`).
