"""Small helpers shared across the package that know nothing about models (optional imports, ...)."""
