from edgelite.cli import main

raise SystemExit(main())
