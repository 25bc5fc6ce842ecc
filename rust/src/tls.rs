//! TLS (rustls on the `ring` provider): the edge's certificate when it serves HTTPS (`--ssl`),
//! and the verification of `https://` nodes against the system's roots or a given CA file.

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::ring::default_provider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::error::{Error, Kind, Result};

/// HTTP/1.1 is all either side speaks.
const ALPN: &[u8] = b"http/1.1";

fn config_error(what: String, e: impl std::fmt::Display) -> Error {
    Error::new(Kind::Config, format!("{what}: {e}"))
}

/// The edge's server side: the certificate chain and private key in PEM files.
pub(crate) fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerConfig>> {
    let chain = CertificateDer::pem_file_iter(cert_file)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| config_error(format!("cannot read the certificate {}", cert_file.display()), e))?;
    if chain.is_empty() {
        return Err(Error::new(Kind::Config, format!("{} holds no certificate", cert_file.display())));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| config_error(format!("cannot read the private key {}", key_file.display()), e))?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error("TLS".to_owned(), e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| config_error(format!("{} and {} do not match", cert_file.display(), key_file.display()), e))?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}

/// The client side, for `https://` nodes: verified against `ca_file`, or the system's roots.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    if let Some(path) = ca_file {
        for cert in CertificateDer::pem_file_iter(path)
            .map_err(|e| config_error(format!("cannot read the CA file {}", path.display()), e))?
        {
            let cert = cert.map_err(|e| config_error(format!("invalid certificate in {}", path.display()), e))?;
            roots.add(cert).map_err(|e| config_error(format!("unusable certificate in {}", path.display()), e))?;
        }
    } else {
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    }
    if roots.is_empty() {
        let source = ca_file.map_or_else(|| "the system".to_owned(), |p| p.display().to_string());
        return Err(Error::new(Kind::Config, format!("no CA certificate found in {source} to verify https nodes")));
    }
    let mut config = ClientConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| config_error("TLS".to_owned(), e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(config))
}

/// The name a node's certificate must carry: its host (an IP address, or a DNS name).
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>> {
    ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']').to_owned())
        .map_err(|e| Error::with_source(Kind::InvalidNode, format!("{host} is not a valid TLS server name"), e))
}
