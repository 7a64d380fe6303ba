"""What every service shares: argparse types, sizes, loopback checks, bearer tokens, the HTTP server setup."""
