//! Certificates made in the test (rcgen): a CA, a server certificate for 127.0.0.1 and
//! localhost, and a client certificate, as PEM files in a temporary directory.

use super::nats::files_dir;

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca: String,
    pub server_cert: String,
    pub server_key: String,
    pub client_cert: String,
    pub client_key: String,
}

pub fn make_pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa,
        KeyPair as CertKey,
    };
    let dir = files_dir();
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write pem");
        path.to_str().expect("utf8").to_owned()
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, CertKey::generate().expect("key")).expect("ca");
    let leaf = |names: Vec<String>, purpose: ExtendedKeyUsagePurpose| {
        let key = CertKey::generate().expect("key");
        let mut params = CertificateParams::new(names).expect("params");
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &ca).expect("sign");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_cert, client_key) = leaf(
        vec!["gateway.test".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    Pki {
        ca: write("ca.pem", ca.pem()),
        server_cert: write("server.pem", server_cert),
        server_key: write("server-key.pem", server_key),
        client_cert: write("client.pem", client_cert),
        client_key: write("client-key.pem", client_key),
        dir,
    }
}
