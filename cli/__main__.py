from modelfleet.cli.commands import main

raise SystemExit(main())
