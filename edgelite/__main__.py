from edgelite.cli.main import main

raise SystemExit(main())
