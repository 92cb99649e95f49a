//! The connector's etcd mode against a real etcd serving TLS, with authentication enabled:
//! with the CA that signed etcd's certificate (`NIXL_CONNECTOR_ETCD_CA_FILE`) and the etcd
//! user and password, the prefill publishes its metadata over `https://` and the decode
//! fetches it and loads every byte; without the CA, with another CA, or by a name etcd's
//! certificate does not list, the fetch is refused with what to do. Then against an etcd
//! that wants a client certificate (`--client-cert-auth`), without authentication: with the
//! client certificate (`NIXL_CONNECTOR_ETCD_CERT_FILE`, `_KEY_FILE`) the same, without it
//! refused. The certificates are
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
    ETCD_CERT_FILE_ENV, ETCD_KEY_FILE_ENV, ETCD_PASSWORD_ENV, ETCD_USER_ENV,
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

/// A certificate and key (`name.pem`, `name.key`) in `dir` with the extensions `ext`,
/// signed by the CA `ca` (see [`make_ca`]).
fn make_cert(dir: &Path, name: &str, ca: &str, ext: &str) -> Result<(PathBuf, PathBuf), String> {
    let (pem, key, csr) = (
        format!("{name}.pem"),
        format!("{name}.key"),
        format!("{name}.csr"),
    );
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
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    )?;
    let ext_file = format!("{name}.ext");
    std::fs::write(dir.join(&ext_file), ext).map_err(|err| err.to_string())?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "1",
            "-extfile",
            &ext_file,
        ],
    )?;
    Ok((dir.join(pem), dir.join(key)))
}

/// The files of the test: the CA, another CA, etcd's certificate and key (for the address
/// 127.0.0.1 only, not the name `localhost`; also a client's, as etcd's gateway dials etcd
/// with it), and a client's certificate and key, all signed by the CA.
struct Files {
    ca: PathBuf,
    other_ca: PathBuf,
    server: (PathBuf, PathBuf),
    client: (PathBuf, PathBuf),
}

fn make_files(dir: &Path) -> Result<Files, String> {
    let server_ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n";
    Ok(Files {
        ca: make_ca(dir, "ca")?,
        other_ca: make_ca(dir, "other-ca")?,
        server: make_cert(dir, "server", "ca", server_ext)?,
        client: make_cert(dir, "client", "ca", "extendedKeyUsage=clientAuth\n")?,
    })
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
    let files = match make_files(dir.path()) {
        Ok(files) => files,
        Err(reason) => return connector::skip(TEST, &reason),
    };
    let Files {
        ca,
        other_ca,
        server: (cert, server_key),
        client: (client_cert, client_key),
    } = &files;
    let etcd = match Etcd::start_tls(cert, server_key, None) {
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
    std::env::set_var(ETCD_CA_FILE_ENV, ca);
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
    let trusted = EtcdTls::from_files(ca, None).unwrap();
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
    let other = EtcdTls::from_files(other_ca, None).unwrap();
    let err = fetch(https.clone(), Some(other))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("TLS with 127.0.0.1"), "{err}");
    assert!(err.contains("not signed by a CA"), "{err}");
    let by_name = https.replace("127.0.0.1", "localhost");
    let err = fetch(by_name, Some(trusted.clone()))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not name \"localhost\""), "{err}");
    // A file without a certificate for the CA is refused when read.
    let err = EtcdTls::from_files(server_key, None)
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
    drop(decode);

    // An etcd that wants a client certificate its CA signed, without authentication: the
    // connector still publishes itself (NIXL's client speaks no TLS), showing the client
    // certificate; a client without one is refused.
    let guarded = match Etcd::start_tls(cert, server_key, Some(ca)) {
        Ok(etcd) => etcd,
        Err(reason) => panic!("the first etcd started, the second did not: {reason}"),
    };
    let https = guarded.tls_endpoint.clone().unwrap();
    // No worker exists now.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &https);
    std::env::remove_var(ETCD_USER_ENV);
    std::env::remove_var(ETCD_PASSWORD_ENV);
    std::env::set_var(ETCD_CERT_FILE_ENV, client_cert);
    std::env::set_var(ETCD_KEY_FILE_ENV, client_key);
    let prefill = etcd_worker("pf-etcd-mtls");
    fill(&prefill, &spec(2));
    let decode = etcd_worker("dc-etcd-mtls");
    let engine = prefill.handshake().unwrap().engine_id;
    connector::loads::load(&decode, &prefill, &spec(2), &engine, "mtls", blocks)
        .await
        .unwrap();
    let key = metadata_key(&namespace, prefill.agent().name());
    let shown = EtcdTls::from_files(ca, Some((client_cert, client_key))).unwrap();
    let stored = fetch_metadata_with(&https, &key, 1 << 20, deadline, None, Some(&shown))
        .await
        .unwrap();
    assert_eq!(stored, prefill.agent().local_metadata().unwrap());
    let err = fetch_metadata_with(&https, &key, 1 << 20, deadline, None, Some(&trusted))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(ETCD_CERT_FILE_ENV), "{err}");
}
