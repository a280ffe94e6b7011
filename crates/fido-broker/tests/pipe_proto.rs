//! The pipe requests at the protocol level, with a raw client: wrong
//! descriptor counts, other domains' pipes, unknown ids, malformed operations
//! — each a clear error on that request, the session and the broker fine.

use std::os::fd::AsFd;

use fido_test_support::Defaults;
use fido_proto::{ErrorCode, PipeEnd, PipeOp, Reply, Request};

type TestBroker = fido_test_support::TestBroker<Defaults>;

#[test]
fn pipe_requests_are_checked() {
    let b = TestBroker::start_with(|c| c.pipe.capacity = fido_broker::Capacity::Unlimited);
    let mut a = b.client();
    a.join("pipe-a");
    let mut other = b.client();
    other.join("pipe-b");

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, b"0123456789").unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let (s0, s1) = std::os::unix::net::UnixStream::pair().unwrap();

    // Wrong descriptor counts.
    for fds in [
        vec![],
        vec![f.as_fd()],
        vec![f.as_fd(), s0.as_fd(), s1.as_fd()],
    ] {
        let (r, _) = a.request_fds(Request::PipeCreate, &fds);
        let e = r.unwrap_err();
        assert_eq!(e.code, ErrorCode::BadDescriptor);
        assert!(e.message.contains("exactly two descriptors"), "{e}");
        let (r, _) = a.request_fds(
            Request::PipeOnce {
                op: PipeOp::FileToSocket { off: 0, len: 1 },
            },
            &fds,
        );
        assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    }
    // Descriptors on a request that takes none.
    let (r, _) = a.request_fds(Request::PipeCancel { pipe: 1 }, &[f.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);

    // A real pipe; another domain cannot use, cancel or destroy it.
    let (r, _) = a.request_fds(Request::PipeCreate, &[f.as_fd(), s0.as_fd()]);
    let Ok(Reply::PipeCreated { pipe, .. }) = r else {
        panic!("{r:?}")
    };
    for req in [
        Request::PipeRun {
            pipe,
            op: PipeOp::FileToSocket { off: 0, len: 1 },
        },
        Request::PipeCancel { pipe },
        Request::PipeDestroy { pipe },
    ] {
        assert_eq!(other.err_code(req), ErrorCode::NoSuchPipe);
    }
    assert_eq!(
        a.err_code(Request::PipeRun {
            pipe: pipe + 100,
            op: PipeOp::SocketToSocket { len: 1 }
        }),
        ErrorCode::NoSuchPipe
    );

    // Offsets beyond 2^63 are refused when decoding (BadRequest).
    let e = a.err_code(Request::PipeRun {
        pipe,
        op: PipeOp::FileToSocket {
            off: u64::MAX,
            len: 1,
        },
    });
    assert_eq!(e, ErrorCode::BadRequest);
    let e = a.err_code(Request::PipeWeight {
        domain: "pipe-a".into(),
        weight: 0,
    });
    assert_eq!(e, ErrorCode::BadRequest);

    // The owner's pipe works and its result is exact.
    match a.request(Request::PipeRun {
        pipe,
        op: PipeOp::FileToSocket { off: 3, len: 100 },
    }) {
        Ok(Reply::PipeDone(r)) => assert_eq!((r.moved, r.consumed, r.end), (7, 7, PipeEnd::Eof)),
        other => panic!("{other:?}"),
    }
    let mut got = [0u8; 7];
    std::io::Read::read_exact(&mut &s1, &mut got).unwrap();
    assert_eq!(&got, b"3456789");
    a.ok(Request::PipeDestroy { pipe });
    assert_eq!(
        a.err_code(Request::PipeDestroy { pipe }),
        ErrorCode::NoSuchPipe
    );

    // Both sessions are still fine.
    assert!(matches!(a.request(Request::Status), Ok(Reply::Status(_))));
    assert!(matches!(
        other.request(Request::Status),
        Ok(Reply::Status(_))
    ));
}
