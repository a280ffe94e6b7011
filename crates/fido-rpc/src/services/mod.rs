//! Ready-made services: the benchmark service of the VMRPC paper's evaluation
//! (null call, ByteSeq, FixedSeq, VarSeq) and the file-serving case study.

pub mod bench;
pub mod files;
