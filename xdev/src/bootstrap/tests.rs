use super::*;

fn detect(vars: &[(&str, &str)]) -> Result<Launcher> {
    Launcher::detect(|n| {
        vars.iter()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.to_string())
    })
}

#[test]
fn the_launcher_is_chosen_in_order_xdev_run_pmix_pmi() {
    let xdev = [(XDEV_BOOTSTRAP, "127.0.0.1:1"), (XDEV_RANK, "0")];
    let pmix = [(PMIX_RANK, "0"), (PMIX_NAMESPACE, "slurm.pmix.7.0")];
    let hydra = [(PMI_FD, "6"), (PMI_RANK, "0"), (PMI_SIZE, "3")];
    let slurm_pmi2 = [
        (PMI_FD, "11"),
        (PMI_RANK, "0"),
        (PMI_SIZE, "3"),
        (PMI_JOBID, "7.0"),
    ];
    let all: Vec<_> = [&xdev[..], &pmix, &slurm_pmi2].concat();
    assert_eq!(detect(&all).unwrap(), Launcher::XdevRun);
    assert_eq!(detect(&[(XDEV_RANK, "1")]).unwrap(), Launcher::XdevRun);
    let pmix_and_pmi: Vec<_> = [&pmix[..], &hydra].concat();
    assert_eq!(detect(&pmix_and_pmi).unwrap(), Launcher::Pmix);
    assert_eq!(detect(&hydra).unwrap(), Launcher::Pmi1);
    assert_eq!(detect(&slurm_pmi2).unwrap(), Launcher::Pmi2);
    let forced: Vec<_> = [&slurm_pmi2[..], &[(XDEV_PMI, "1")]].concat();
    assert_eq!(detect(&forced).unwrap(), Launcher::Pmi1);
    let forced: Vec<_> = [&hydra[..], &[(XDEV_PMI, "2")]].concat();
    assert_eq!(detect(&forced).unwrap(), Launcher::Pmi2);
    let bad: Vec<_> = [&hydra[..], &[(XDEV_PMI, "3")]].concat();
    assert!(matches!(detect(&bad), Err(Error::Config(m)) if m.contains(XDEV_PMI)));
    // Half of PMIx's pair is not PMIx; empty values do not count.
    assert!(detect(&[(PMIX_RANK, "0")]).is_err());
    assert!(detect(&[(XDEV_BOOTSTRAP, ""), (PMI_FD, "")]).is_err());
}

#[test]
fn no_launcher_names_all_three_ways_to_start_a_job() {
    for vars in [&[][..], &[(PMI_RANK, "0"), (PMI_SIZE, "2")][..]] {
        match detect(vars) {
            Err(Error::Config(m)) => {
                for way in [
                    "xdev-run",
                    "srun --mpi=pmix",
                    "mpirun.openmpi",
                    "mpirun.mpich",
                    "srun --mpi=pmi2",
                ] {
                    assert!(m.contains(way), "{way} missing from {m}");
                }
            }
            r => panic!("expected the no-launcher error, got {r:?}"),
        }
    }
    let m = detect(&[(PMI_RANK, "0")]).unwrap_err().to_string();
    assert!(m.contains("PMI_FD is not"), "{m}");
}

#[test]
fn secret_hex_roundtrip() {
    let s = Secret::generate().unwrap();
    assert_eq!(Secret::from_hex(&s.to_hex()).unwrap(), s);
    assert_eq!(
        Secret::from_hex(&s.to_hex().to_uppercase()).unwrap(),
        s,
        "either case"
    );
    assert!(Secret::from_hex("abc").is_err());
    assert!(Secret::from_hex(&"g".repeat(64)).is_err());
    assert!(Secret::from_hex(&"+f".repeat(32)).is_err());
    assert!(Secret::from_hex(&"é".repeat(32)).is_err());
    assert_eq!(format!("{s:?}"), "Secret(..)");
}

#[test]
fn a_device_config_must_match_the_environment_and_the_connection() {
    let secret = Secret::generate().unwrap();
    let server = BootstrapServer::start(
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        1,
        "job-a",
        secret.clone(),
    )
    .unwrap();
    let vars = [
        (XDEV_RANK, "0".to_string()),
        (XDEV_SIZE, "1".to_string()),
        (XDEV_JOB, "job-a".to_string()),
        (XDEV_BOOTSTRAP, server.addr().to_string()),
        (XDEV_SECRET, secret.to_hex()),
    ];
    let env = JobEnv::from_lookup(|n| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.clone()))
        .unwrap();
    let other = Config::new(0, 1, "job-b");
    match Bootstrap::for_config_in(&env, &other) {
        Err(Error::Config(m)) => assert!(m.contains("the environment says"), "{m}"),
        r => panic!("expected a config error, got {:?}", r.map(|_| ())),
    }
    let boot = Bootstrap::for_config_in(&env, &Config::new(0, 1, "job-a")).unwrap();
    assert!(boot.check_config(&Config::new(0, 1, "job-a")).is_ok());
    assert!(matches!(boot.check_config(&other), Err(Error::Config(_))));
}
