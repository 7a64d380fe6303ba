"""Test support that users' own suites can use too: local Redis servers, free ports, a tiny checkpoint."""
