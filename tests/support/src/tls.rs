//! Certificates made at test time: a CA, and certificates it signs for 127.0.0.1.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::TlsFiles;

/// A certificate authority made for one test.
pub struct TestCa {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A CA named `name`.
    ///
    /// # Panics
    ///
    /// When rcgen cannot make one.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let pem = params.self_signed(&key).expect("a CA certificate").pem();
        TestCa {
            pem,
            issuer: Issuer::new(params, key),
        }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for 127.0.0.1 and localhost, signed by this CA, for a server or a
    /// client (Redis Cluster nodes present it to each other; a client presents it for
    /// mutual TLS).
    ///
    /// # Panics
    ///
    /// When rcgen cannot make one.
    pub fn server_files(&self) -> TlsFiles {
        let key = KeyPair::generate().expect("a key");
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("certificate parameters");
        params
            .distinguished_name
            .push(DnType::CommonName, "tollway test server");
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).expect("a certificate");
        TlsFiles {
            ca_cert: self.pem.clone(),
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}
