use super::*;

#[test]
fn hands_a_descriptor_to_this_process_only_when_it_is_in_the_job() {
    let offer = FdOffer::listen().unwrap();
    assert!(valid_offer_name(offer.name()));
    let name = offer.name().to_string();
    let file = std::fs::File::open("/proc/self/status").unwrap();
    let copy = || OwnedFd::from(file.try_clone().unwrap());
    let server = offer.serve(vec![(std::process::id(), vec![copy(), copy()])]);
    let me = std::process::id();
    assert!(
        take("xdev-fd-00000000000000000000000000000000", 2, me).is_err(),
        "no such offer"
    );
    let got = take(&name, 2, me).unwrap();
    assert_eq!(got.len(), 2);
    let got = got.into_iter().next().unwrap();
    server.join().unwrap().unwrap();
    // The same open file: its inode matches.
    let a = std::fs::metadata(format!("/proc/self/fd/{}", got.as_raw_fd())).unwrap();
    let b = file.metadata().unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()));

    // A process of this user outside the job's pids gets nothing, and
    // the hand-over fails at once (a rank whose view of the records
    // differs from ours).
    let offer = FdOffer::listen().unwrap();
    let name = offer.name().to_string();
    let server = offer.serve(vec![(1, vec![copy()])]);
    let e = take(&name, 1, me).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
        ),
        "{e}"
    );
    let e = server.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains(&format!("process {me} ")), "{e}");
}

#[test]
fn a_taker_refuses_an_offer_served_by_another_process_than_the_published_one() {
    let offer = FdOffer::listen().unwrap();
    let name = offer.name().to_string();
    let file = std::fs::File::open("/proc/self/status").unwrap();
    let me = std::process::id();
    let server = offer.serve(vec![(me, vec![OwnedFd::from(file)])]);
    // The record said pid 1 serves this offer; this process does.
    let e = take(&name, 1, 1).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.to_string().contains(&format!("served by process {me} ")),
        "{e}"
    );
    // Nothing was received: the server is still waiting for its taker.
    assert!(!server.is_finished());
    let got = take(&name, 1, me).unwrap();
    assert_eq!(got.len(), 1);
    server.join().unwrap().unwrap();
}
