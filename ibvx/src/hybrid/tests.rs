use xdev::bootstrap::Secret;
use xdev::{Config, Envelope, Error, Pattern, Source, Status, TagSel};

use super::route::RankMap;
use super::setup::{host_indices, host_key, parse_service};
use super::HybridOptions;

fn config(opts: &[&str]) -> Config {
    Config::new(0, 4, "j").with_assignments(opts).unwrap()
}

#[test]
fn options_split_by_prefix_and_check_the_remote() {
    let o = HybridOptions::from_config(&config(&[
        "remote=psm",
        "local.eager_limit=1024",
        "remote.rndv_shm_bytes=4096",
        "simulate_hosts=2",
    ]))
    .unwrap();
    assert_eq!(o.remote, "psm");
    assert_eq!(o.simulate_hosts, Some(2));
    assert_eq!(o.local_options, vec![("eager_limit".into(), "1024".into())]);
    assert_eq!(
        o.remote_options,
        vec![("rndv_shm_bytes".into(), "4096".into())]
    );
    assert_eq!(
        HybridOptions::from_config(&config(&[])).unwrap().remote,
        "ibv"
    );
    assert!(matches!(
        HybridOptions::from_config(&config(&["remote=tcp"])),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        HybridOptions::from_config(&config(&["simulate_hosts=0"])),
        Err(Error::Config(_))
    ));
    // A misspelled key, and a key without its prefix, name the known ones.
    for bad in ["remot=psm", "eager_limit=64"] {
        match HybridOptions::from_config(&config(&[bad])) {
            Err(Error::UnknownOption(u)) => {
                assert_eq!(u.device, "hybrid");
                assert_eq!(u.known, ["remote", "simulate_hosts", "local.", "remote."]);
            }
            other => panic!("{bad}: expected UnknownOption, got {other:?}"),
        }
    }
    assert!(matches!(
        HybridOptions::from_config(&config(&["simulate_hosts=two"])),
        Err(Error::BadOption(b)) if b.expected == "a count, at least 1"
    ));
}

#[test]
fn hosts_group_by_key_in_order_of_appearance() {
    let keys: Vec<Vec<u8>> = ["b", "a", "b", "c", "a"]
        .iter()
        .map(|k| k.as_bytes().to_vec())
        .collect();
    assert_eq!(host_indices(&keys), vec![0, 1, 0, 2, 1]);
    let sim: Vec<_> = (0..4).map(|r| host_key(Some(2), r, 4).unwrap()).collect();
    assert_eq!(host_indices(&sim), vec![0, 0, 1, 1]);
    let real = host_key(None, 0, 1).unwrap();
    assert!(real.len() > 36, "boot id and host name: {real:?}");
}

#[test]
fn service_records_parse_or_blame_the_leader() {
    let secret = Secret::generate().unwrap();
    let good = format!("127.0.0.1:4000 {}", secret.to_hex());
    let (addr, s) = parse_service(good.as_bytes(), 2).unwrap();
    assert_eq!((addr.port(), s), (4000, secret));
    for bad in [&b"127.0.0.1:4000"[..], b"nowhere 00", b"\xff\xfe"] {
        assert!(
            matches!(parse_service(bad, 2), Err(Error::Protocol { rank: 2, .. })),
            "{bad:?}"
        );
    }
    assert!(matches!(
        parse_service(b"127.0.0.1:4000 zz", 2),
        Err(Error::Config(_))
    ));
}

#[test]
fn local_ranks_map_to_job_ranks() {
    let map = RankMap {
        to_job: Some(vec![2, 3].into()),
        size: 4,
    };
    let env = Envelope {
        source: 1,
        tag: 5,
        context: 0,
    };
    let st = map.status(Status::received(env, 10, 4));
    assert_eq!(st.source, 3);
    assert!(matches!(
        st.error.as_deref(),
        Some(Error::Truncated { sender: 3, .. })
    ));
    assert!(matches!(
        map.error(Error::PeerLost {
            rank: 0,
            reason: "x".into()
        }),
        Error::PeerLost { rank: 2, .. }
    ));
    // A cancelled receive's `usize::MAX` source is not a rank.
    assert_eq!(
        map.status(Status::cancelled(Pattern::new(Source::Any, TagSel::Any, 0)))
            .source,
        usize::MAX
    );
}
