use super::*;

#[test]
fn macs_bind_every_field() {
    let s = Secret::from_bytes([7; 32]);
    let (ns, nc) = ([1; NONCE_LEN], [2; NONCE_LEN]);
    let c = Claim {
        server_nonce: &ns,
        client_nonce: &nc,
        rank: 1,
        size: 4,
        job: "j",
    };
    let m = client_mac(&s, &c);
    assert!(verify_client(&s, &c, &m));
    assert!(!verify_server(&s, &c, &m), "labels separate the directions");
    assert!(!verify_client(&Secret::from_bytes([8; 32]), &c, &m));
    let other = Claim { rank: 2, ..c };
    assert!(!verify_client(&s, &other, &m));
    let sm = server_mac(&s, &other);
    assert!(verify_server(&s, &other, &sm));
    assert_ne!(random::<32>().unwrap(), random::<32>().unwrap());
}
