"""What every service shares: argparse types, the store flag group (store_args), sizes, listen
addresses and the loopback rule, tenant tokens, the HTTP server setup."""
