//! PEM files: certificate chains and private keys. Every error names the file, so a config error
//! says which of `cert`, `key` or `ca` is wrong and why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// `path` as written in the config, relative to the config file's directory.
pub fn resolve(config: &Path, path: &str) -> PathBuf {
    match config.parent() {
        Some(dir) => dir.join(path),
        None => PathBuf::from(path),
    }
}

/// Reads the file first so that an unreadable file is told apart from one with no PEM in it.
fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))
}

/// Every `CERTIFICATE` block of `path`, in order (leaf first for a chain); at least one.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("`{}` is not valid PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "`{}` has no `BEGIN CERTIFICATE` block",
            path.display()
        ));
    }
    Ok(certs)
}

/// The first private key of `path` (PKCS#8, PKCS#1 RSA or SEC1 EC).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => {
            format!("`{}` has no `BEGIN ... PRIVATE KEY` block", path.display())
        }
        e => format!("`{}` is not a valid PEM private key: {e}", path.display()),
    })
}

/// A certificate chain and its key, checked to belong together: a server presenting a key that
/// does not match its certificate fails every handshake.
pub fn certified_key(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, String> {
    let chain = certificates(cert)?;
    let der = private_key(key)?;
    CertifiedKey::from_der(chain, der, &super::provider())
        .map(Arc::new)
        .map_err(|e| {
            format!(
                "`{}` and `{}` do not make a usable certificate: {e}",
                cert.display(),
                key.display()
            )
        })
}
