//! One way to print an error for a log line or a C caller: the error and its sources,
//! `: `-separated, on one line (every crate of the workspace prints them so).

/// `e` and each of its sources, `: `-separated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("reading the map")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_error_prints_with_each_of_its_sources() {
        let e = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(error_chain(&e), "reading the map: disk on fire");
        assert_eq!(error_chain(&std::io::Error::other("alone")), "alone");
    }
}
