"""The shared serving core: authentication and tenants, quotas, admission, accounting and the
usage ledger, metrics. Every request class is built on it; it never imports a request class or an
entrypoint."""
