use fido_test_support::pipes::*;
use std::os::unix::fs::FileExt;

type TestBroker = fido_test_support::TestBroker<Pipes>;

#[test]
fn file_to_socket_and_file_to_file() {
    let b = TestBroker::start();
    let c = b.client("smoke");
    let data = pattern(3 << 20, 1);
    let (_, f) = file_with(b.dir.path(), "src", &data);
    let (tx, rx) = stream_pair();
    let got = drain(rx);
    let p = c.create(&f, &tx).unwrap();
    let t = p.file_to_socket(0, data.len() as u64).unwrap();
    assert_eq!((t.moved, t.eof), (data.len() as u64, false));
    drop(p);
    drop(tx);
    assert_eq!(sum(&got.join().unwrap()), sum(&data));

    let (_, out) = rw_file(b.dir.path(), "dst");
    let t = c.file_to_file(&f, &out, 5, 1 << 20, 7).unwrap();
    assert_eq!(t.moved, 1 << 20);
    let mut back = vec![0u8; 1 << 20];
    out.read_exact_at(&mut back, 7).unwrap();
    assert_eq!(sum(&back), sum(&data[5..5 + (1 << 20)]));
}
