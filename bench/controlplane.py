"""Control-plane benchmark: GET and traffic-POST requests/s and p99 with 50 concurrent clients, on SQLite
and PostgreSQL, against `GET /health` in the same run; one JSON line. The benchmark lives with the control
plane (`modelfleet.controlplane.bench`) so that it ships with it; this is its entry point in bench/.

    python bench/controlplane.py [--clients 50] [--requests 2000] [--backends sqlite,postgresql]
"""

from modelfleet.controlplane.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
