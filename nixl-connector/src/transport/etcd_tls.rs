//! TLS to etcd for the connector's etcd paths (`https://` endpoints), through rustls with
//! the `ring` provider: the CA that signed etcd's certificate from a PEM file
//! ([`ETCD_CA_FILE_ENV`]), and optionally a client certificate and key for etcd's
//! `--client-cert-auth` ([`ETCD_CERT_FILE_ENV`], [`ETCD_KEY_FILE_ENV`]). No system roots
//! are trusted: an `https://` endpoint without the CA is refused. [`Endpoint`] is one etcd
//! endpoint as the connector speaks to it, plain or through TLS.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};

/// The environment variable naming a PEM file of the CA certificates that signed etcd's
/// server certificate; needed for `https://` endpoints.
pub const ETCD_CA_FILE_ENV: &str = "NIXL_CONNECTOR_ETCD_CA_FILE";

/// The environment variable naming a PEM file of this client's certificate (chain), for an
/// etcd that asks for one (`--client-cert-auth`); with [`ETCD_KEY_FILE_ENV`].
pub const ETCD_CERT_FILE_ENV: &str = "NIXL_CONNECTOR_ETCD_CERT_FILE";

/// The environment variable naming a PEM file of the private key of
/// [`ETCD_CERT_FILE_ENV`]'s certificate.
pub const ETCD_KEY_FILE_ENV: &str = "NIXL_CONNECTOR_ETCD_KEY_FILE";

/// What the connector trusts, and shows, when it speaks TLS to etcd. Its `Debug` shows
/// nothing of the key.
#[derive(Clone)]
pub struct EtcdTls {
    config: Arc<ClientConfig>,
    client_certificate: bool,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.client_certificate)
            .finish_non_exhaustive()
    }
}

const OP: &str = "set up TLS to etcd";

/// Reads the certificates of the PEM file `path`, which `what` names in errors.
fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|err| Error::invalid(OP, format!("{what} {shown}: {err}")))?;
    if certs.is_empty() {
        return Err(Error::invalid(
            OP,
            format!("{what} {shown} holds no PEM certificate (\"BEGIN CERTIFICATE\")"),
        ));
    }
    Ok(certs)
}

impl EtcdTls {
    /// Trusts the CA certificates of the PEM file `ca` for etcd's certificate, and shows the
    /// client certificate and key of `client` (PEM files) when etcd asks for one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the file and what is wrong with it: unreadable, no
    /// certificate or key in it, a certificate that is not a CA's, a key that does not fit.
    pub fn from_files(ca: &Path, client: Option<(&Path, &Path)>) -> Result<Self> {
        let mut roots = RootCertStore::empty();
        for cert in certificates(ca, &format!("the CA file ({ETCD_CA_FILE_ENV})"))? {
            roots.add(cert).map_err(|err| {
                Error::invalid(OP, format!("the CA file {}: {err}", ca.display()))
            })?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|err| Error::invalid(OP, err.to_string()))?
            .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = certificates(
                    cert,
                    &format!("the client certificate file ({ETCD_CERT_FILE_ENV})"),
                )?;
                let key_file = key.display();
                let key = PrivateKeyDer::from_pem_file(key).map_err(|err| {
                    Error::invalid(
                        OP,
                        format!("the client key file ({ETCD_KEY_FILE_ENV}) {key_file}: {err}"),
                    )
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|err| {
                    Error::invalid(
                        OP,
                        format!(
                            "the client certificate {} with the key {key_file}: {err}",
                            cert.display()
                        ),
                    )
                })?
            }
        };
        Ok(EtcdTls {
            config: Arc::new(config),
            client_certificate: client.is_some(),
        })
    }

    /// [`EtcdTls::from_files`] of the files [`ETCD_CA_FILE_ENV`], and [`ETCD_CERT_FILE_ENV`]
    /// with [`ETCD_KEY_FILE_ENV`], name; `None` without a CA file.
    ///
    /// # Errors
    /// As [`EtcdTls::from_files`]; [`Error::InvalidArgument`] for a client certificate
    /// without its key, or the other way round, or either without a CA file.
    pub fn from_env() -> Result<Option<Self>> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let (ca, cert, key) = (
            var(ETCD_CA_FILE_ENV),
            var(ETCD_CERT_FILE_ENV),
            var(ETCD_KEY_FILE_ENV),
        );
        let client = match (&cert, &key) {
            (Some(cert), Some(key)) => Some((Path::new(cert), Path::new(key))),
            (None, None) => None,
            _ => {
                return Err(Error::invalid(
                    OP,
                    format!("set both {ETCD_CERT_FILE_ENV} and {ETCD_KEY_FILE_ENV}, or neither"),
                ))
            }
        };
        match ca {
            Some(ca) => Self::from_files(Path::new(&ca), client).map(Some),
            None if client.is_some() => Err(Error::invalid(
                OP,
                format!("a client certificate needs {ETCD_CA_FILE_ENV}, the CA of etcd's"),
            )),
            None => Ok(None),
        }
    }
}

/// One etcd endpoint as the connector speaks to it: its `host:port`, and the TLS to speak
/// there for an `https://` URL.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    /// `host:port`.
    pub(crate) host: String,
    /// The name etcd's certificate must carry, and what to trust; `None` for `http://`.
    tls: Option<(ServerName<'static>, EtcdTls)>,
}

/// A byte stream to etcd, plain or through TLS.
trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// The longest exchange a deadline is set for; a longer timeout means no sooner end.
const LONGEST_EXCHANGE: Duration = Duration::from_secs(86_400);

/// A TCP stream whose reads and writes all end by one deadline, that of the whole exchange:
/// each operation may take only the time left, so a slow endpoint cannot stretch an
/// exchange by answering a byte at a time.
struct DeadlineTcp {
    tcp: TcpStream,
    deadline: Instant,
}

impl DeadlineTcp {
    /// The time left, or `TimedOut` once the deadline has passed.
    fn left(&self) -> std::io::Result<Duration> {
        self.deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the exchange's deadline passed",
                )
            })
    }
}

impl Read for DeadlineTcp {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.tcp.set_read_timeout(Some(left))?;
        self.tcp.read(buf)
    }
}

impl Write for DeadlineTcp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let left = self.left()?;
        self.tcp.set_write_timeout(Some(left))?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

impl Endpoint {
    /// The endpoint at `host` (`host:port`), spoken to through TLS with `tls` when `https`.
    ///
    /// # Errors
    /// Why it cannot be spoken to: `https` without `tls`, or a host that is no server name.
    pub(crate) fn new(
        host: &str,
        https: bool,
        tls: Option<&EtcdTls>,
    ) -> std::result::Result<Endpoint, String> {
        if !https {
            return Ok(Endpoint {
                host: host.to_string(),
                tls: None,
            });
        }
        let Some(tls) = tls else {
            return Err(format!(
                "the endpoint speaks TLS: set {ETCD_CA_FILE_ENV} to a PEM file of the CA that \
                 signed etcd's certificate"
            ));
        };
        let name = host
            .rsplit_once(':')
            .map_or(host, |(name, _)| name)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = ServerName::try_from(name.to_string())
            .map_err(|err| format!("{name:?} is not a host name: {err}"))?;
        Ok(Endpoint {
            host: host.to_string(),
            tls: Some((name, tls.clone())),
        })
    }

    /// Sends `request` and reads the answer up to its end or `cap` bytes, the whole
    /// exchange (connecting, the TLS handshake, writing and reading) within `timeout`
    /// (blocking).
    pub(crate) fn exchange(
        &self,
        request: &[u8],
        cap: u64,
        timeout: Duration,
    ) -> std::result::Result<Vec<u8>, String> {
        let addr = self
            .host
            .to_socket_addrs()
            .map_err(|err| err.to_string())?
            .next()
            .ok_or("the host name resolves to no address")?;
        let deadline = Instant::now() + timeout.min(LONGEST_EXCHANGE);
        let tcp = TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
        let tcp = DeadlineTcp { tcp, deadline };
        let mut stream: Box<dyn Stream> = match &self.tls {
            None => Box::new(tcp),
            Some((name, tls)) => {
                let mut tcp = tcp;
                let mut conn = ClientConnection::new(tls.config.clone(), name.clone())
                    .map_err(|err| err.to_string())?;
                while conn.is_handshaking() {
                    conn.complete_io(&mut tcp)
                        .map_err(|err| self.failure(err))?;
                }
                Box::new(StreamOwned::new(conn, tcp))
            }
        };
        // With TLS 1.3 etcd refuses a client certificate after the client's handshake has
        // ended: its alert comes with the answer.
        stream.write_all(request).map_err(|e| self.failure(e))?;
        let mut answer = Vec::new();
        stream
            .take(cap)
            .read_to_end(&mut answer)
            .map_err(|e| self.failure(e))?;
        Ok(answer)
    }

    /// As [`Endpoint::exchange`], on tokio; the caller bounds the time.
    pub(crate) async fn exchange_async(
        &self,
        request: &[u8],
        cap: u64,
    ) -> std::result::Result<Vec<u8>, String> {
        let tcp = tokio::net::TcpStream::connect(&self.host)
            .await
            .map_err(|err| err.to_string())?;
        let answer = match &self.tls {
            None => talk(tcp, request, cap).await,
            Some((name, tls)) => {
                let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
                match connector.connect(name.clone(), tcp).await {
                    Ok(stream) => talk(stream, request, cap).await,
                    Err(err) => Err(err),
                }
            }
        };
        answer.map_err(|err| self.failure(err))
    }

    /// What went wrong on the connection; for TLS's errors, with what to do about them.
    fn failure(&self, err: std::io::Error) -> String {
        use rustls::{AlertDescription, CertificateError, Error as Tls};
        let hint = match err.get_ref().and_then(|e| e.downcast_ref::<Tls>()) {
            Some(Tls::InvalidCertificate(CertificateError::UnknownIssuer)) => format!(
                ": etcd's certificate is not signed by a CA of {ETCD_CA_FILE_ENV}; name the \
                 CA that signed it"
            ),
            Some(Tls::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => format!(
                ": etcd's certificate does not name {:?}; use a host name or address its \
                 certificate lists in the endpoint",
                self.tls
                    .as_ref()
                    .map(|(name, _)| name.to_str())
                    .unwrap_or_default()
            ),
            Some(Tls::AlertReceived(
                AlertDescription::CertificateRequired
                | AlertDescription::BadCertificate
                | AlertDescription::HandshakeFailure,
            )) => format!(
                ": etcd may ask for a client certificate its CA signed ({ETCD_CERT_FILE_ENV}, \
                 {ETCD_KEY_FILE_ENV})"
            ),
            Some(_) => String::new(),
            None => return err.to_string(),
        };
        format!("TLS with {} failed: {err}{hint}", self.host)
    }
}

/// Sends `request` on `stream` and reads the answer up to its end or `cap` bytes.
async fn talk<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    request: &[u8],
    cap: u64,
) -> std::io::Result<Vec<u8>> {
    stream.write_all(request).await?;
    let mut answer = Vec::new();
    (&mut stream).take(cap).read_to_end(&mut answer).await?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_ca_file_is_named() {
        let err = EtcdTls::from_files(Path::new("/nonexistent/ca.pem"), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
        assert!(err.contains(ETCD_CA_FILE_ENV), "{err}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = std::env::temp_dir().join(format!("nixl-etcd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let err = EtcdTls::from_files(&path, None).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains("holds no PEM certificate"), "{err}");
    }

    #[test]
    fn an_endpoint_answering_a_byte_at_a_time_is_given_up_at_the_exchanges_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let host = listener.local_addr().unwrap().to_string();
        // The answer trickles in for 5 s: each byte comes well within a per-read timeout.
        let server = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            for _ in 0..50 {
                if peer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let endpoint = Endpoint::new(&host, false, None).unwrap();
        let start = Instant::now();
        let err = endpoint
            .exchange(
                b"GET / HTTP/1.1\r\n\r\n",
                1 << 20,
                Duration::from_millis(500),
            )
            .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "given up after {:?}: {err}",
            start.elapsed()
        );
        server.join().unwrap();
    }

    #[test]
    fn https_without_a_ca_says_which_variable() {
        let err = Endpoint::new("127.0.0.1:1", true, None).unwrap_err();
        assert!(err.contains(ETCD_CA_FILE_ENV), "{err}");
    }
}
