//! The connector's etcd mode against a real etcd serving TLS, with authentication enabled:
//! with the CA that signed etcd's certificate (`NIXL_CONNECTOR_ETCD_CA_FILE`) and the etcd
//! user and password, the prefill publishes its metadata over `https://` and the decode
//! fetches it and loads every byte; without the CA, with another CA, or by a name etcd's
//! certificate does not list, the fetch is refused with what to do. The certificates are
//! made at test time with the `openssl` CLI. Alone in its binary: it sets the environment
//! NIXL and the connector read when a worker is created.
//!
//! Needs the `etcd` binary (Debian package etcd-server) and `openssl`; without them the test
//! fails under CI, and elsewhere is skipped and listed in the summary.

#[path = "../nixl-connector/tests/common/mod.rs"]
mod connector;
mod demo_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use connector::{fill, spec, worker_with};
use demo_support::Etcd;
use nixl_connector::etcd::{
    fetch_metadata_with, metadata_key, EtcdCredentials, EtcdTls, ETCD_CA_FILE_ENV,
    ETCD_PASSWORD_ENV, ETCD_USER_ENV,
};
use nixl_connector::{KvConnectorWorker, MetadataExchange};

const PASSWORD: &str = "etcd password of the TLS test";

/// Runs `openssl` with `args` in `dir`, or says why it failed.
fn openssl(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|err| format!("openssl: {err}"))?;
    if !out.status.success() {
        return Err(format!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// A self-signed CA, `name.pem` with its key `name.key`, in `dir`.
fn make_ca(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &pem,
            "-days",
            "1",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    )?;
    Ok(dir.join(pem))
}

/// etcd's certificate and key (`server.pem`, `server.key`) in `dir`, signed by the CA
/// `ca`, for the address 127.0.0.1 only (not the name `localhost`).
fn make_server_cert(dir: &Path, ca: &str) -> Result<(PathBuf, PathBuf), String> {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=etcd of the test",
        ],
    )?;
    let ext = dir.join("server.ext");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .map_err(|err| err.to_string())?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "1",
            "-extfile",
            "server.ext",
        ],
    )?;
    Ok((dir.join("server.pem"), dir.join("server.key")))
}

fn etcd_worker(engine: &str) -> KvConnectorWorker {
    worker_with(engine, 0, 1, &spec(2), |config| {
        config.metadata_exchange = MetadataExchange::Etcd;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_goes_through_an_etcd_serving_tls() {
    const TEST: &str = "metadata_goes_through_an_etcd_serving_tls";
    let dir = tempfile::tempdir().unwrap();
    let made = make_ca(dir.path(), "ca").and_then(|ca| {
        let other = make_ca(dir.path(), "other-ca")?;
        let (cert, key) = make_server_cert(dir.path(), "ca")?;
        Ok((ca, other, cert, key))
    });
    let (ca, other_ca, cert, server_key) = match made {
        Ok(files) => files,
        Err(reason) => return connector::skip(TEST, &reason),
    };
    let etcd = match Etcd::start_tls(&cert, &server_key) {
        Ok(etcd) => etcd,
        Err(reason) => return connector::skip(TEST, &reason),
    };
    etcd.enable_auth(PASSWORD);
    let https = etcd.tls_endpoint.clone().unwrap();
    let namespace = format!("/nixl-rs-etcd-tls-{}", std::process::id());
    // Set before any worker exists; this process has no other test.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &https);
    std::env::set_var("NIXL_ETCD_NAMESPACE", &namespace);
    std::env::set_var(ETCD_USER_ENV, "root");
    std::env::set_var(ETCD_PASSWORD_ENV, PASSWORD);
    std::env::set_var(ETCD_CA_FILE_ENV, &ca);
    connector::init_tracing();

    let prefill = etcd_worker("pf-etcd-tls");
    fill(&prefill, &spec(2));
    let decode = etcd_worker("dc-etcd-tls");
    let engine = prefill.handshake().unwrap().engine_id;
    let blocks: (&[usize], &[usize]) = (&[3, 6], &[0, 2]);
    connector::loads::load(&decode, &prefill, &spec(2), &engine, "over-tls", blocks)
        .await
        .unwrap();

    let key = metadata_key(&namespace, prefill.agent().name());
    let root = EtcdCredentials::new("root", PASSWORD);
    let trusted = EtcdTls::from_files(&ca, None).unwrap();
    let deadline = Duration::from_secs(5);
    let fetch = |url: String, tls: Option<EtcdTls>| {
        let (key, root) = (key.clone(), root.clone());
        async move {
            fetch_metadata_with(&url, &key, 1 << 20, deadline, Some(&root), tls.as_ref()).await
        }
    };
    let stored = fetch(https.clone(), Some(trusted.clone())).await.unwrap();
    assert_eq!(stored, prefill.agent().local_metadata().unwrap());

    // Without the CA, with another CA, or by a name the certificate does not list: refused,
    // each saying what to do.
    let err = fetch(https.clone(), None).await.unwrap_err().to_string();
    assert!(err.contains(ETCD_CA_FILE_ENV), "{err}");
    let other = EtcdTls::from_files(&other_ca, None).unwrap();
    let err = fetch(https.clone(), Some(other))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("TLS handshake with 127.0.0.1"), "{err}");
    assert!(err.contains("not signed by a CA"), "{err}");
    let by_name = https.replace("127.0.0.1", "localhost");
    let err = fetch(by_name, Some(trusted.clone()))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not name \"localhost\""), "{err}");
    // A file without a certificate for the CA is refused when read.
    let err = EtcdTls::from_files(&server_key, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("holds no PEM certificate"), "{err}");

    // Dropped, the prefill withdraws its metadata, over TLS.
    drop(prefill);
    let err = fetch_metadata_with(
        &https,
        &key,
        1 << 20,
        Duration::from_millis(500),
        Some(&root),
        Some(&trusted),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("no metadata under it"), "{err}");
}
